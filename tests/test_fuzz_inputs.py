"""Fuzzed inputs at every edge that reads the outside world (tests/support/fuzz.py says how).

Each property: accepted and kept exactly, or refused with the project's error naming the
field / line; never another exception type, a 5xx, a record lost or half-written. CI budgets
are small and derandomized; benchmarks/fuzz_inputs.py runs the same properties with >= 10k
cases. Below each property, the defects fuzzing found, as plain regression tests.
"""
import json
import pathlib
import tempfile

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.support import fuzz as fz

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def tmp():
  with tempfile.TemporaryDirectory() as d:
    yield pathlib.Path(d)


# -- trace JSONL import --------------------------------------------------------------------------

@FUZZ
@given(fz.trace_file())
def test_trace_import_keeps_valid_records_and_names_each_bad_line(tmp, lines):
  fz.check_trace_import(tmp, lines)


def _call(**kw) -> dict:
  rec = {"schema_version": 1, "type": "call", "id": "c1", "tenant": "t", "session": "s",
         "created": 1.0, "kind": "chat", "request": {}, "messages": None, "tools": None,
         "prompt_text": "x", "prompt_ids": [1, 2], "parent_call": None, "parent_choice": None,
         "break_reason": None, "status": "complete", "reason": None, "finished": 2.0,
         "response": {}, "choices": [], "latency_s": 0.5}
  rec.update(kw)
  return rec


_DEFECTS = [  # (the broken field, the record): each aborted, or silently dropped, an import
    ("prompt_ids", _call(prompt_ids=[2**40])),        # OverflowError (int32 blob)
    ("created", _call(created=float("nan"))),         # NOT NULL: the record vanished, no error
    ("created", _call(created=2**70)),                # OverflowError binding an INTEGER
    ("parent_call", _call(parent_call={"a": 1})),     # sqlite ProgrammingError
    ("prompt_text", _call(prompt_text="\ud800")),     # UnicodeEncodeError in SQLite
    ("schema_version", _call(schema_version=True)),   # True == 1 passed the version check
    ("finished", _call(status="error", finished=None, response=None, latency_s=None)),
    ("choices", _call(status="incomplete", finished=None, response=None, latency_s=None,
                      choices=[{"index": 0, "token_ids": [1], "logprobs": [-1.0],
                                "finish_reason": "stop", "version": 0, "text": "",
                                "message": None}])),  # the choices were dropped silently
]


@pytest.mark.parametrize("field, rec", _DEFECTS)
def test_trace_import_regressions(tmp, field, rec):
  good = _call(id="good")
  lines = [(fz.dumps(good), good, None), (fz.dumps(rec), rec, field)]
  assert fz.check_trace_import(tmp, lines) == "rejected"


@pytest.mark.parametrize("raw", [b"\xff\xfe{}", b"[" * 5000, b'{"a": ' + b"9" * 5000 + b"}"])
def test_trace_import_unreadable_lines_are_one_error_each(tmp, raw):
  """Not UTF-8 (UnicodeDecodeError ended the import), too deep (RecursionError), a 5000-digit
  int (ValueError): each is an error naming its line, and the valid line is kept."""
  good = _call(id="good")
  assert fz.check_trace_import(tmp, [(raw, None, None), (fz.dumps(good), good, None)]) == \
      "rejected"


def test_trace_import_numbers_lines_at_newlines_only(tmp):
  """A bare \\r split a line in two (universal newlines): every later line number was off."""
  good = _call(id="good")
  lines = [(fz.dumps(good) + b"\rjunk", None, None), (b"junk2", None, None),
           (fz.dumps(_call(id="g2")), _call(id="g2"), None)]
  assert fz.check_trace_import(tmp, lines) == "rejected"


# -- proxy request bodies ------------------------------------------------------------------------

@settings(FUZZ, max_examples=300)
@given(case=fz.request_body())
def test_request_bodies_parse_or_name_the_field(case):
  fz.check_request(*case)


_BODIES = [  # (chat, body, field): each was a 500 or a reset connection from the real server
    (False, b'{"model": "posttrain_jax", "prompt": [18446744073709551616]}', "prompt"),
    (False, b'{"model": "posttrain_jax", "prompt": [1099511627776]}', "prompt"),   # int32 blob
    (False, b'{"model": "posttrain_jax", "prompt": [600]}', "prompt"),       # >= vocab (512)
    (True, b"[" * 5000, None),                                               # RecursionError
    (True, b'{"model": ' + b"9" * 5000 + b"}", None),                        # ValueError
    (True, b'{"model": "posttrain_jax", "\\ud800": 1}', None),   # the 400 could not be encoded
    (False, b'{"model": "posttrain_jax", "prompt": "\\ud800"}', "prompt"),   # tokenizer error
    (True, b'{"model": "posttrain_jax", "messages": [{"role": "user", "content": "x"}], '
           b'"seed": -1}', "seed"),                          # SeedSequence: a 503 from the engine
]


@pytest.mark.parametrize("chat, raw, field", _BODIES)
def test_request_regressions(chat, raw, field):
  assert fz.check_request(chat, raw, field, None) == "rejected"


@pytest.fixture(scope="module")
def proxy_client(tmp):
  from tests.support import byoh as bt
  from tests.support import envs as et
  tok = et.tokenizer("hermes")
  engine = et.ScriptedEngine(tok, lambda _, k: "ok", et.stop_ids(tok, "hermes")[0])
  with bt.running(engine, tmp / "http.db") as (url, proxy), \
      httpx.Client(base_url=url, timeout=30) as client:
    yield client, proxy


@settings(FUZZ, max_examples=40)
@given(case=fz.request_body())
def test_http_bodies_are_2xx_or_a_4xx_naming_the_field_and_recording_nothing(proxy_client,
                                                                               case):
  fz.check_request_http(*proxy_client, *case)


@pytest.mark.parametrize("chat, raw, field", _BODIES[:7])
def test_http_regressions(proxy_client, chat, raw, field):
  assert fz.check_request_http(*proxy_client, chat, raw, field, None) == "rejected"


# -- task files ----------------------------------------------------------------------------------

@settings(FUZZ, max_examples=100)
@given(case=fz.task_file())
def test_task_files_load_or_name_file_and_line(tmp, case):
  fz.check_task_file(tmp, *case)


@pytest.mark.parametrize("line, field", [
    (b"[" * 5000, None),                                      # RecursionError escaped
    (b'{"prompt": "q", "answer": ' + b"9" * 5000 + b"}", None),   # ValueError escaped
    (fz.dumps({"prompt": "\ud800", "answer": "1"}), "prompt"),  # UnicodeEncodeError (held out)
])
def test_task_file_regressions(tmp, line, field):
  rows = [{"id": "a", "prompt": "p", "answer": "1"}, {"id": "b"}]
  assert fz.check_task_file(tmp, [fz.dumps(rows[0]), line], rows, 1, field) == "rejected"


def test_an_explicit_id_equal_to_a_default_id_is_a_duplicate(tmp):
  """Line 1 has no id ("tasks.jsonl:1"); line 2 names that id: two tasks, one id, no error."""
  from posttrain_jax.tasks import JsonlSource, TaskBankError
  path = tmp / "tasks.jsonl"
  path.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n" +
                  json.dumps({"id": "tasks.jsonl:1", "prompt": "b", "answer": "2"}) + "\n")
  with pytest.raises(TaskBankError, match=rf"{path}:2: duplicate id 'tasks.jsonl:1'"):
    JsonlSource(str(path))


# -- config overrides ----------------------------------------------------------------------------

@settings(FUZZ, max_examples=100)
@given(case=fz.overrides(fz.config_leaves()))
def test_config_overrides_build_or_raise_one_user_error_naming_the_field(case):
  fz.check_overrides(*case)


@pytest.mark.parametrize("flag", [
    "--config.tasks.generator.sub=1",      # TypeError (string indices) from ml_collections
    "--config.tasks.num_epochs.sub=1",     # ValueError: the field is None
    "--config.rl.steps=" + "9" * 30,       # accepted: an int past int64
    "--config.rl.learner.optimizer.learning_rate=1e999",   # accepted: inf
    "--config.rl.learner.optimizer.learning_rate=nan",     # accepted: nan
    "--config.sft.steps=1\n2",             # a two-line error message
    "--config.rl.async_correction=0",      # "config.rl: 'unknown off-policy correction ...'"
])
def test_config_override_regressions(flag):
  field = flag.split("=")[0][len("--config."):]
  assert fz.check_overrides([flag], [field]) == "rejected"


def test_a_float_field_given_a_huge_int_is_a_config_error():
  from posttrain_jax.config_io import ConfigTypeError
  from posttrain_jax.run_config import run_config_from_dict
  with pytest.raises(ConfigTypeError, match="learning_rate: expected a finite float"):
    run_config_from_dict({"rl": {"learner": {"optimizer": {"learning_rate": 10**400}}}})


# -- HF config.json ------------------------------------------------------------------------------

@settings(FUZZ, max_examples=150)
@given(case=fz.hf_config())
def test_hf_configs_parse_to_a_buildable_config_or_name_key_and_file(tmp, case):
  fz.check_hf_config(tmp, *case)


def _hf(**kw) -> bytes:
  from posttrain_jax.models.config import ModelConfig, to_hf_dict
  hf = to_hf_dict(ModelConfig(family="llama", vocab_size=64, hidden_size=32,
                              intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=8))
  hf.update(kw)
  return fz.dumps({k: v for k, v in hf.items() if v != fz.DROP})


@pytest.mark.parametrize("raw, key", [
    (_hf(num_attention_heads=0, head_dim=fz.DROP), "num_attention_heads"),  # ZeroDivisionError
    (_hf(hidden_size="32", head_dim=fz.DROP), "hidden_size"),               # TypeError
    (b"[1]", None),                                                         # AttributeError
    (b"\xff{}", None),                                                      # UnicodeDecodeError
    (b"[" * 5000, None),                                                    # RecursionError
    (_hf(layer_types=3), "layer_types"),                                    # TypeError
    (_hf(rope_parameters=[1]), "rope_parameters"),                          # TypeError
    (_hf(architectures=[[1]]), "architectures"),                            # unhashable list
    (_hf(rope_parameters={"rope_type": "yarn"}), "rope_parameters"),        # no file named
    # accepted, then failed (or built nonsense) when the model was built:
    (_hf(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}), "rope_parameters"),
    (_hf(max_position_embeddings=None), "max_position_embeddings"),
    (_hf(head_dim=7), "head_dim"),
    (_hf(vocab_size=-1), "vocab_size"),
    (_hf(tie_word_embeddings="false"), "tie_word_embeddings"),
])
def test_hf_config_regressions(tmp, raw, key):
  assert fz.check_hf_config(tmp, raw, key) == "rejected"


def test_a_rope_list_value_keeps_the_config_hashable(tmp):
  assert fz.check_hf_config(tmp, _hf(rope_parameters={
      "rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 2]}), None) == "ok"
