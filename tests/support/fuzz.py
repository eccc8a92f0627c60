"""Fuzzed inputs for every edge that reads the outside world, and the contract each must keep.

One valid input is drawn, then (usually) exactly one thing in it is broken: a field set to an
arbitrary JSON value (huge ints, NaN, lone surrogates, nesting), a field deleted, an unknown
field added, or the whole line / body / file replaced by garbage bytes. Because only one field
differs from a valid input, a rejection must name that field (or a field it is checked
against, `_RELATED`); an acceptance must keep the value exactly. Each `check_*` returns "ok"
(accepted) or "rejected" (refused with the project's clear error) and raises AssertionError
when the contract fails (a defect). tests/test_fuzz_inputs.py runs them under hypothesis with
CI-sized budgets; benchmarks/fuzz_inputs.py runs them with >= 10k cases.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any, Optional

from hypothesis import strategies as st

MODEL = "posttrain_jax"
DROP = "<drop>"                 # a mutation that deletes the field

# -- arbitrary JSON ------------------------------------------------------------------------------

_SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=())
TEXT = st.text(st.one_of(st.characters(exclude_categories=()), _SURROGATE), max_size=8)
_INTS = st.one_of(st.integers(-3, 3), st.integers(),
                  st.sampled_from([2**31 - 1, 2**31, 2**63, -2**63 - 1, 10**30, 10**400]))
SCALARS = st.one_of(st.none(), st.booleans(), _INTS, st.floats(), TEXT)
JSON = st.recursive(SCALARS, lambda c: st.one_of(st.lists(c, max_size=3),
                                                 st.dictionaries(TEXT, c, max_size=3)),
                    max_leaves=6)
GARBAGE = st.one_of(st.binary(max_size=24), st.sampled_from(
    [b"[" * 5000, b'{"a": ' + b"9" * 5000 + b"}", b'{"a": "\\ud800"}', b"\xff\xfe{}", b"null",
     b"[]", b'"x"', b"{\"a\": 1", b"NaN", b"\r{}\r"]))


def same(a: Any, b: Any) -> bool:
  """JSON equality with NaN equal to itself and 1 == 1.0 (SQLite REAL reads ints back as floats)."""
  if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
    return True
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
  return a == b and type(a) in (type(b), int, float) and type(b) in (type(a), int, float)


def dumps(value: Any) -> bytes:
  """JSON bytes of any drawn value (ASCII escapes keep lone surrogates writable)."""
  return json.dumps(value).encode()


@st.composite
def mutation(draw, fields: list[str], extra: bool = True):
  """(field, new value) for one of `fields` (DROP deletes it), or an unknown field added."""
  if extra and draw(st.integers(0, 9)) == 0:
    return draw(TEXT), draw(JSON)
  return draw(st.sampled_from(fields)), draw(st.one_of(st.just(DROP), JSON))


def names(msg: str, field: str, related: dict[str, tuple[str, ...]]) -> bool:
  return any(f in msg for f in (field, *related.get(field, ())))


# -- 1. trace JSONL import -----------------------------------------------------------------------

_TRACE_RELATED = {"finished": ("status", "choices", "response", "latency_s"),
                  "status": ("finished",), "choices": ("finished",),
                  "response": ("finished",), "latency_s": ("finished",),
                  "choices[0]": ("'choices'",), "type": ("lacks field",)}


def _printable(name: str) -> bool:
  """A field name without lone surrogates (an error can quote it)."""
  try:
    name.encode("utf-8")
  except UnicodeEncodeError:
    return False
  return True


@st.composite
def trace_record(draw, i: int) -> dict:
  """A valid exported call or feedback record with a unique id."""
  if draw(st.integers(0, 3)) == 0:
    return {"schema_version": 1, "type": "feedback", "id": f"fb-{i}", "tenant": "t",
            "session": draw(st.sampled_from(["s1", "s2"])), "call_id": None,
            "created": draw(st.floats(0, 1e9)), "grade": draw(st.none() | st.floats(0, 1)),
            "rubric": draw(st.none() | st.dictionaries(st.text(max_size=4), st.floats(0, 1),
                                                       max_size=2)),
            "text": draw(st.none() | st.text(max_size=8)), "source": "api"}
  n = draw(st.integers(0, 3))
  finished = draw(st.none() | st.floats(0, 1e9))
  status = "incomplete" if finished is None else draw(st.sampled_from(
      ["complete", "incomplete", "error"]))
  choices = [] if finished is None else [
      {"index": k, "token_ids": [5] * n, "logprobs": [-0.5] * n, "finish_reason": "stop",
       "version": 0, "text": draw(st.text(max_size=6)),
       "message": draw(st.none() | st.just({"role": "assistant", "content": "x"}))}
      for k in range(draw(st.integers(0, 2)))]
  return {"schema_version": 1, "type": "call", "id": f"call-{i}", "tenant": "t",
          "session": draw(st.sampled_from(["s1", "s2"])), "created": draw(st.floats(0, 1e9)),
          "kind": draw(st.sampled_from(["chat", "completion"])),
          "request": {"model": MODEL, "n": draw(st.integers(1, 3))},
          "messages": draw(st.none() | st.just([{"role": "user", "content": "hi"}])),
          "tools": None, "prompt_text": draw(st.text(max_size=8)),
          "prompt_ids": draw(st.lists(st.integers(0, 2**31 - 1), max_size=4)),
          "parent_call": None, "parent_choice": None, "break_reason": None, "status": status,
          "reason": None, "finished": finished, "response": None if finished is None else {},
          "choices": choices, "latency_s": None if finished is None else 0.25}


@st.composite
def trace_file(draw) -> list[tuple[bytes, Optional[dict], Optional[str]]]:
  """Lines of an export: (bytes, the record if the line is one, the field broken in it)."""
  lines = []
  for i in range(draw(st.integers(1, 6))):
    rec = draw(trace_record(i))
    kind = draw(st.integers(0, 5))
    if kind == 0:
      lines.append((draw(GARBAGE).replace(b"\n", b" "), None, None))
      continue
    field = None
    if kind == 1 and rec.get("choices"):   # break a field inside the first choice
      field = "choices[0]"
      rec["choices"] = [dict(c) for c in rec["choices"]]
      k, v = draw(mutation(sorted(rec["choices"][0]), extra=False))
      rec["choices"][0].pop(k) if v is DROP else rec["choices"][0].__setitem__(k, v)
    elif kind <= 3:
      field, value = draw(mutation(sorted(rec)))
      if value is DROP:
        rec.pop(field, None)
      else:
        rec[field] = value
    lines.append((dumps(rec), rec, field))
    if draw(st.booleans()):
      lines.append((b"  \n" if draw(st.booleans()) else b"\n", None, None))
  return lines


def _readback(store, rec: dict) -> dict:
  if rec["type"] == "feedback":
    (fb,) = [f for f in store.feedback(rec["tenant"]) if f.id == rec["id"]]
    return dataclasses.asdict(fb)
  return store.call(rec["id"]).to_json()


def _expected(rec: dict) -> dict:
  out = {k: v for k, v in rec.items() if k not in ("schema_version", "type")}
  if rec["type"] == "call" and rec["finished"] is None:   # no result row
    out.update(reason="no result recorded (the proxy stopped mid-call)")
  return out


def check_trace_import(tmp: pathlib.Path, lines) -> str:
  from posttrain_jax.byoh.store import StoreConfig, StoreError, TraceStore
  path = tmp / "export.jsonl"
  path.write_bytes(b"".join(line if line.endswith(b"\n") else line + b"\n"
                            for line, _, _ in lines))
  store = TraceStore(StoreConfig(path=str(tmp / "fuzz.db"), synchronous="OFF"))
  try:
    stored, errors = store.import_jsonl(str(path))
    by_line = {}
    for e in errors:
      assert e.startswith(f"{path}:"), e
      lineno, msg = e[len(f"{path}:"):].split(": ", 1)
      assert lineno.isdigit() and int(lineno) not in by_line, e
      assert "\n" not in msg and msg, e
      by_line[int(lineno)] = msg
    seen, new = set(), 0
    for lineno, (raw, rec, field) in enumerate(lines, 1):
      if not raw.strip():
        assert lineno not in by_line, (lineno, by_line[lineno])
        continue
      if lineno in by_line:
        msg = by_line[lineno]
        assert rec is None or field is not None, \
            f"line {lineno}: a valid record was refused: {msg} ({raw[:200]!r})"
        if field is not None and _printable(field):
          assert names(msg, field, _TRACE_RELATED), f"line {lineno}: {field!r} broken, " \
              f"error says {msg!r}"
        continue
      assert rec is not None, f"line {lineno}: garbage accepted: {raw[:200]!r}"
      key = (rec["type"], rec["id"])
      if key not in seen:       # a record already present (an id met before) is skipped
        seen.add(key)
        new += 1
        got, want = _readback(store, rec), _expected(rec)
        assert same(got, {k: want.get(k) for k in got}), f"line {lineno}: stored {got} for {rec}"
    assert stored == new, (stored, new)
    assert store.import_jsonl(str(path)) == (0, errors)   # again: nothing new, same errors
  except StoreError as e:
    raise AssertionError(f"import raised instead of reporting per line: {e}") from e
  finally:
    store.close()
    for f in tmp.glob("fuzz.db*"):
      f.unlink()
  return "rejected" if errors else "ok"


# -- 2. proxy request bodies ---------------------------------------------------------------------

_API_RELATED = {"max_completion_tokens": ("max_tokens",), "max_tokens": ("max_completion_tokens",)}
_CHAT_KEYS = ["model", "messages", "max_tokens", "temperature", "top_p", "n", "seed", "stop",
              "stream", "logprobs", "tools", "tool_choice", "top_k", "presence_penalty",
              "logit_bias", "response_format", "user", "stream_options", "echo", "prompt"]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@st.composite
def request_body(draw):
  """(chat?, body bytes, the top-level field broken, the message index broken)."""
  chat = draw(st.booleans())
  body: dict[str, Any] = {"model": MODEL, "max_tokens": draw(st.integers(1, 16))}
  if chat:
    body["messages"] = [{"role": r, "content": draw(st.text(max_size=10))}
                        for r in draw(st.lists(st.sampled_from(["system", "user", "assistant"]),
                                               min_size=1, max_size=3))]
    if draw(st.booleans()):
      body["tools"] = TOOLS
  else:
    body["prompt"] = draw(st.text(min_size=1, max_size=10) | st.lists(
        st.integers(0, 255), min_size=1, max_size=6))
  for key, s in (("temperature", st.floats(0, 2)), ("top_p", st.floats(0.01, 1)),
                 ("n", st.integers(1, 3)), ("seed", st.integers(0, 2**63 - 1)),
                 ("stop", st.lists(st.text(min_size=1, max_size=3), max_size=4)),
                 ("stream", st.booleans()), ("logprobs", st.booleans())):
    if draw(st.integers(0, 3)) == 0:
      body[key] = draw(s)
  kind = draw(st.integers(0, 9))
  if kind == 0:
    return chat, draw(GARBAGE | JSON.map(dumps)), None, None
  if kind <= 5:
    field, value = draw(mutation(_CHAT_KEYS))
    if value is DROP:
      body.pop(field, None)
    else:
      body[field] = value
    return chat, dumps(body), field, None
  if kind <= 7 and chat:
    i = draw(st.integers(0, len(body["messages"]) - 1))
    k, v = draw(mutation(["role", "content", "tool_calls", "tool_call_id"], extra=False))
    body["messages"][i].pop(k, None) if v is DROP else body["messages"][i].__setitem__(k, v)
    return chat, dumps(body), "messages", i
  return chat, dumps(body), None, None


def _param_names(param: Optional[str], field: str) -> bool:
  """`param` is the field, a part of it (`messages[0].role`), or a field it is read with."""
  return param is not None and (param in (field, *_API_RELATED.get(field, ())) or
                                param.startswith((f"{field}[", f"{field}.")))


def _check_api_error(e, field: Optional[str], index: Optional[int]) -> None:
  body = e.body()
  json.dumps(body, ensure_ascii=False).encode("utf-8")   # what JSONResponse sends
  assert 400 <= e.status < 500 and e.message, body
  if index is not None:
    assert e.param == "messages" or (e.param or "").startswith(f"messages[{index}]"), \
        (e.param, index)
  elif field is not None and _printable(field):
    assert _param_names(e.param, field) or (e.param is None and "surrogate" in e.message), \
        (e.param, field, e.message)


def check_request(chat: bool, raw: bytes, field: Optional[str], index: Optional[int],
                  vocab_size: int = 512) -> str:
  """parse_request + normalize_messages, as the proxy runs them before recording anything."""
  from posttrain_jax.byoh import json_text, openai_api as api
  from posttrain_jax.byoh.prompts import MessageError, normalize_messages
  try:
    try:
      body = json_text.loads(raw)
    except json_text.JsonTextError as e:
      raise api.ApiError(400, f"the body is not valid JSON: {e}", e.field) from None
    req = api.parse_request(body, chat=chat, models=(MODEL,), max_tokens_default=16,
                            max_tokens_limit=64, max_n=4, stop_token_ids=(1,),
                            vocab_size=vocab_size)
    if chat:
      try:
        normalize_messages(req.messages)
      except MessageError as e:
        raise api.ApiError(400, str(e), e.param) from None
  except api.ApiError as e:
    _check_api_error(e, field, index)
    return "rejected"
  assert 1 <= req.sampling.max_tokens <= 64 and 1 <= req.n <= 4
  assert chat or isinstance(req.prompt, str) or all(0 <= t < vocab_size for t in req.prompt)
  return "ok"


def _count_calls(store) -> int:
  return sum(len(store.calls(t)) for t in store.tenants())


def check_request_http(client, proxy, chat: bool, raw: bytes, field: Optional[str],
                       index: Optional[int]) -> str:
  """The body POSTed to the running proxy: a 2xx (recorded), or a 4xx with an OpenAI-style
  body naming the field (nothing recorded); never a 5xx or a dropped connection."""
  before = _count_calls(proxy.store)
  r = client.post("/v1/chat/completions" if chat else "/v1/completions", content=raw,
                  headers={"content-type": "application/json", "x-session-id": "fuzz"})
  after = _count_calls(proxy.store)
  assert r.status_code < 500, (r.status_code, r.text[:500], raw[:300])
  if r.status_code >= 400:
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "param" in err, err
    if index is not None:
      assert err["param"] == "messages" or (err["param"] or "").startswith(
          f"messages[{index}]"), err
    elif field is not None and field in _CHAT_KEYS:
      assert _param_names(err["param"], field) or (
          err["param"] is None and "surrogate" in err["message"]), (err, field)
    assert after == before, f"a {r.status_code} recorded {after - before} call(s)"
    return "rejected"
  assert after == before + 1, (before, after)
  if r.headers["content-type"].startswith("text/event-stream"):
    assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
  return "ok"


# -- 3. task files -------------------------------------------------------------------------------

@st.composite
def task_file(draw):
  """(lines, index of the broken line or None, the field broken)."""
  rows = []
  for i in range(draw(st.integers(1, 5))):
    prompt = draw(st.text(max_size=10) | st.just([{"role": "user", "content": "q"}]))
    rows.append({"id": f"task-{i}", "prompt": prompt,
                 "answer": draw(st.text(max_size=4) | st.integers(-99, 99)), "level": i})
  lines = [dumps(r) for r in rows]
  bad, field = None, None
  kind = draw(st.integers(0, 4))
  if kind:
    bad = draw(st.integers(0, len(rows) - 1))
    if kind == 1:
      lines[bad] = draw(GARBAGE).replace(b"\n", b" ")
    else:
      field, value = draw(mutation(["prompt", "answer", "id", "level"]))
      row = dict(rows[bad])
      if value is DROP:
        row.pop(field, None)
      else:
        row[field] = value
      rows[bad] = row
      lines[bad] = dumps(row)
  return lines, rows, bad, field


def check_task_file(tmp: pathlib.Path, lines, rows, bad: Optional[int],
                    field: Optional[str]) -> str:
  from posttrain_jax.tasks import JsonlSource, TaskBankError
  path = tmp / "tasks.jsonl"
  path.write_bytes(b"\n".join(lines) + b"\n")
  try:
    src = JsonlSource(str(path), eval_fraction=0.3)
  except TaskBankError as e:
    msg = str(e)
    assert bad is not None, f"valid file refused: {msg}"
    line = next((ln for ln in msg.splitlines() if f"{path}:{bad + 1}: " in ln), None)
    if line is None and not lines[bad].strip():
      assert "contains no tasks" in msg or f"{path}:" in msg, msg   # a blank line is skipped
      return "rejected"
    if field == "id" and "duplicate id" in msg:   # the id of another line: the later refused
      return "rejected"
    assert line is not None, f"line {bad + 1} broken, error says {msg!r}"
    if field is not None and field in ("prompt", "answer") and "surrogate" not in line:
      assert field in line, f"{field!r} broken, error says {line!r}"
    return "rejected"
  nonblank = [i for i, ln in enumerate(lines) if ln.strip()]
  assert len(src) == len(nonblank), (len(src), nonblank)
  for k, i in enumerate(nonblank):
    task, row = src[k], rows[i]
    assert same(task.prompt, row["prompt"]), (task.prompt, row)
    assert task.answer == str(row["answer"]), (task.answer, row)
  return "ok"


# -- 4. config overrides -------------------------------------------------------------------------

DEFAULT_CONFIG = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "default.py")


def config_leaves() -> list[tuple[str, Any]]:
  """(dotted path, default value) of every leaf of configs/default.py."""
  from ml_collections.config_flags.config_flags import ConfigFileFlagParser
  cfg = ConfigFileFlagParser(name="config").parse(DEFAULT_CONFIG).to_dict()
  out = []

  def walk(node, prefix):
    for k, v in node.items():
      if isinstance(v, dict) and v:
        walk(v, prefix + (k,))
      out.append((".".join(prefix + (k,)), v))
  walk(cfg, ())
  return out


_VALUES = st.one_of(
    st.sampled_from(["0", "-1", "1", "1e999", "nan", "-inf", "true", "False", "None", "",
                     "abc", "9" * 30, "0.5", "[1, 2]", "{}", "{'a': 1}", "(1,)", "2**40"]),
    st.integers().map(str), st.floats().map(repr), st.text(max_size=8))


@st.composite
def overrides(draw, leaves):
  """1-2 `--config.<path>=<value>` flags (sometimes a path with a typo or an extra part)."""
  out, fields = [], []
  for _ in range(draw(st.integers(1, 2))):
    path, _ = draw(st.sampled_from(leaves))
    r = draw(st.integers(0, 9))
    if r == 0:
      path = path + "x"
    elif r == 1:
      path = path + ".sub"
    value = draw(_VALUES).replace("\x00", "")
    out.append(f"--config.{path}={value}")
    fields.append(path)
  return out, fields


def check_overrides(argv: list[str], fields: list[str]) -> str:
  """launch/train.py's parsing: flags -> ConfigDict -> RunConfig; a UserError or a config."""
  from absl import flags
  from posttrain_jax.errors import UserError
  from posttrain_jax.launch import cli
  from posttrain_jax.run_config import run_config_from_dict
  fv = flags.FlagValues()
  try:
    cli._parse_flags(["train.py", *argv], DEFAULT_CONFIG, fv)
    run_config_from_dict(fv.config.to_dict())
  except UserError as e:
    msg = str(e)
    assert msg and "\n" not in msg, f"not one line: {msg!r}"
    leaves = [f.split(".")[-1] for f in fields]
    assert any(leaf.rstrip("x") in msg or f in msg for leaf, f in zip(leaves, fields)), \
        f"{argv}: error names none of {fields}: {msg!r}"
    return "rejected"
  return "ok"


# -- 5. HF config.json ---------------------------------------------------------------------------

_HF_RELATED = {
    "num_attention_heads": ("num_key_value_heads", "hidden_size", "head_dim"),
    "hidden_size": ("num_attention_heads", "head_dim"),
    "num_key_value_heads": ("num_attention_heads",),
    "head_dim": ("hidden_size", "num_attention_heads"),
    "rope_parameters": ("rope_", "rope_theta"), "rope_scaling": ("rope_",),
    "use_sliding_window": ("sliding_window",), "max_window_layers": ("sliding_window",),
    "num_hidden_layers": ("sliding_window", "layer_types"),
    "architectures": ("architecture",), "model_type": ("architecture",),
}
HF_KEYS = ["architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
           "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
           "hidden_act", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
           "tie_word_embeddings", "max_position_embeddings", "bos_token_id", "eos_token_id",
           "pad_token_id", "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window",
           "max_window_layers", "layer_types", "partial_rotary_factor"]
_SIZES = st.sampled_from([0, -1, 1, 3, 2**31, 10**12, 2.5, "8", True, None])


@st.composite
def hf_config(draw):
  """(file bytes, the key broken or None)."""
  from posttrain_jax.models.config import ModelConfig, to_hf_dict
  family = draw(st.sampled_from(["llama", "qwen2", "qwen3"]))
  hf = to_hf_dict(ModelConfig(family=family, vocab_size=64, hidden_size=32, intermediate_size=64,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8))
  kind = draw(st.integers(0, 9))
  if kind == 0:
    return draw(GARBAGE | JSON.map(dumps)), None
  if kind == 1:
    return dumps(hf), None
  key = draw(st.sampled_from(HF_KEYS))
  value = draw(st.one_of(st.just(DROP), JSON, _SIZES))
  if key == "rope_parameters" and draw(st.booleans()):
    value = {**hf["rope_parameters"], **draw(st.dictionaries(st.sampled_from(
        ["rope_type", "factor", "low_freq_factor", "high_freq_factor", "rope_theta",
         "original_max_position_embeddings"]), st.one_of(_SIZES, st.sampled_from(
             ["linear", "llama3", "yarn"])), max_size=3))}
  if value is DROP:
    hf.pop(key, None)
  else:
    hf[key] = value
  return dumps(hf), key


def _buildable(cfg) -> None:
  """What the decoder needs of a ModelConfig it accepted (checked without building it)."""
  from posttrain_jax.models.rope import inv_frequencies
  for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "head_dim", "max_position_embeddings"):
    v = getattr(cfg, f)
    assert type(v) is int and 0 < v < 2**31, (f, v)
  assert cfg.num_heads % cfg.num_kv_heads == 0 and cfg.head_dim % 2 == 0, cfg
  assert math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps > 0, cfg.rms_norm_eps
  assert all(isinstance(getattr(cfg, f), bool) for f in ("qkv_bias", "o_bias", "mlp_bias",
                                                         "qk_norm", "tie_word_embeddings"))
  hash(cfg)
  if cfg.head_dim <= 4096:
    inv = inv_frequencies(cfg)
    assert inv.shape == (cfg.head_dim // 2,) and bool((inv > 0).all()), inv


def check_hf_config(tmp: pathlib.Path, raw: bytes, key: Optional[str]) -> str:
  import numpy as np
  from posttrain_jax.models import hf_io
  from posttrain_jax.models.config import ConfigError
  path = tmp / "config.json"
  path.write_bytes(raw)
  try:
    cfg = hf_io.read_model_config(tmp)
  except ConfigError as e:
    msg = str(e)
    assert str(path) in msg, msg
    if key is not None:
      assert names(msg, key, _HF_RELATED), f"{key!r} broken, error says {msg!r}"
    return "rejected"
  with np.errstate(all="raise"):
    _buildable(cfg)
  return "ok"
