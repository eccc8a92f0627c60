"""The OpenAI request fields we serve, validated, and the response bodies we send back.

A request is read field by field (not by a schema library) so that each mistake is one 400
with an OpenAI-style body naming the field: `{"error": {"message", "type", "param", "code"}}`.
Fields the engines cannot honour (penalties, logit bias) are refused with a message that says
so, rather than silently ignored; so are `top_logprobs` and `response_format` where the serving
engine lacks the capability (server.Proxy.prepare checks engines/base.py's capability flags).

Tools: `tool_choice` "auto" (parse the calls the model writes), "none" (the tools are still
rendered, as vLLM does by default, but no call is parsed), "required" or a named function
{"type": "function", "function": {"name"}} (the answer must call a tool / that tool: see
tool_choice.py for how, without constrained decoding), `parallel_tool_calls` false (at
most one call per answer). A request whose `tool_choice` cannot be met within the retries is
answered `Unsatisfied`: a 422 naming the field.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Optional

from posttrain_jax.engines.base import SamplingParams


class ApiError(Exception):
  """An error answered with an OpenAI-style body."""

  def __init__(self, status: int, message: str, param: Optional[str] = None,
               code: Optional[str] = None, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
    self.headers: Optional[dict[str, str]] = None   # sent with the error (429: Retry-After)

  def body(self) -> dict[str, Any]:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code}}


class Unsatisfied(ApiError):
  """The model did not meet `tool_choice` / `parallel_tool_calls` in any of the samples the
  proxy drew: a 422 naming the field. `choices` are the call's last samples (recorded as a
  rejected call, never trained)."""

  def __init__(self, message: str, param: str, choices: list):
    super().__init__(422, message, param, "tool_choice_unsatisfied")
    self.choices = choices


# Accepted and ignored (they change nothing we do), or accepted only at their no-op value.
_IGNORED = {"user", "metadata", "store", "stream_options", "service_tier",
            "reasoning_effort", "modalities", "prediction", "functions", "function_call", "name"}
_NOOP = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
         "echo": False, "suffix": None, "best_of": 1}
MAX_TOP_LOGPROBS = 20             # OpenAI's limit on top_logprobs


@dataclasses.dataclass(frozen=True)
class Request:
  """What a chat or completions call asks for."""
  model: str
  sampling: SamplingParams
  n: int
  seed: Optional[int]
  stop: tuple[str, ...]
  stream: bool
  include_usage: bool
  logprobs: bool
  tools: Optional[list[dict[str, Any]]]
  tool_choice: str                # "auto" | "none" | "required"
  messages: Any = None            # chat: the raw messages (prompts.normalize_messages reads them)
  prompt: Any = None              # completions: a string or a list of token ids
  tool_name: Optional[str] = None  # "required" of one named function: only a call to it counts
  parallel_tool_calls: bool = True  # False: at most one tool call per answer

  @property
  def parses_tools(self) -> bool:
    """Tool calls are parsed out of the answer (tools offered, tool_choice not "none")."""
    return bool(self.tools) and self.tool_choice != "none"


def tool_choice_field(v: Any, tools: Optional[list[dict[str, Any]]],
                      param: str = "tool_choice") -> tuple[str, Optional[str]]:
  """Chat Completions' `tool_choice` as (mode, tool name): mode "auto" | "none" | "required";
  a named function {"type": "function", "function": {"name"}} is ("required", name). A 400
  naming the field for anything else, or a call forced without (that) tool."""
  if v is None:
    return "auto", None
  if v in ("auto", "none", "required"):
    mode, name = v, None
  elif isinstance(v, dict) and v.get("type") == "function":
    fn = v.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
      raise ApiError(400, "a named tool_choice is {type: function, function: {name}}",
                     f"{param}.function.name")
    mode, name = "required", fn["name"]
  else:
    raise ApiError(400, f"tool_choice={json.dumps(v)}; valid: 'auto', 'none', 'required' or "
                   "{type: function, function: {name}}", param)
  return check_forced_tool(mode, name, tools, param)


def check_forced_tool(mode: str, name: Optional[str], tools, param: str,
                      name_param: Optional[str] = None) -> tuple[str, Optional[str]]:
  """(mode, name) if the tools allow it: a forced call needs tools, a named one that tool."""
  if mode == "required" and not tools:
    raise ApiError(400, "tool_choice forces a tool call but the request has no tools", param)
  names = [t["function"]["name"] for t in tools or ()]
  if name is not None and name not in names:
    raise ApiError(400, f"tool_choice names the function {name!r}, which is not among the "
                   f"tools ({', '.join(names)})", name_param or f"{param}.function.name")
  return mode, name


def response_format_field(v: Any, param: str = "response_format") -> Optional[str]:
  """`response_format`: None for plain text, else the validated format as JSON text
  (SamplingParams.response_format): {"type": "json_object"} or {"type": "json_schema",
  "json_schema": {"name", "schema"?, "strict"?}}."""
  if v is None or v == {"type": "text"}:
    return None
  kind = v.get("type") if isinstance(v, dict) else None
  if kind == "json_object":
    return json.dumps({"type": "json_object"})
  if kind == "json_schema":
    js = v.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str) or not js["name"]:
      raise ApiError(400, "json_schema must be an object with a name (a string)",
                     f"{param}.json_schema")
    if js.get("schema") is not None and not isinstance(js["schema"], dict):
      raise ApiError(400, "json_schema.schema must be a JSON schema object",
                     f"{param}.json_schema.schema")
    return json.dumps({"type": "json_schema", "json_schema": js}, sort_keys=True)
  raise ApiError(400, f"response_format={json.dumps(v)}; valid types: text, json_object, "
                 "json_schema", param)


def number(body, key, lo, hi, default, kind=(int, float)):
  """`body[key]` (`default` when absent or null), a number of `kind` in [lo, hi]; else a 400
  naming `key`."""
  v = body.get(key, default)
  if v is None:
    v = default
  if isinstance(v, bool) or not isinstance(v, kind) or not lo <= v <= hi:
    what = "an integer" if kind == (int,) else "a number"
    raise ApiError(400, f"{key} must be {what} in [{lo}, {hi}], got {v!r}", key)
  return v


def seed_field(body: dict) -> Optional[int]:
  """`body["seed"]`: None or an integer in [0, 2**63); else a 400."""
  seed = body.get("seed")
  if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                           or not 0 <= seed < 1 << 63):
    raise ApiError(400, "seed must be an integer in [0, 2**63)", "seed")
  return seed


def parse_request(body: Any, *, chat: bool, models: tuple[str, ...], max_tokens_default: int,
                  max_tokens_limit: int, max_n: int, stop_token_ids: tuple[int, ...],
                  vocab_size: int = 1 << 31) -> Request:
  """The request `body` validated; ApiError (4xx) naming the field. Token ids of a prompt
  must be below `vocab_size` (the tokenizer's): a larger one cannot be decoded or embedded."""
  if not isinstance(body, dict):
    raise ApiError(400, "the request body must be a JSON object")
  model = body.get("model")
  if not isinstance(model, str) or not model:
    raise ApiError(400, "model is required (a string)", "model")
  if model not in models:
    raise ApiError(404, f"the model {model!r} does not exist; served: {', '.join(models)}",
                   "model", "model_not_found")
  for key, noop in _NOOP.items():
    v = body.get(key)
    if v is not None and v != noop:
      raise ApiError(400, f"{key}={v!r} is not supported by this server (the engines sample "
                     f"plain log-probs only)", key, "unsupported_parameter")
  known = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
           "top_p", "n", "seed", "stop", "stream", "logprobs", "tools", "tool_choice", "top_k",
           "top_logprobs", "response_format", "parallel_tool_calls", *_IGNORED, *_NOOP}
  unknown = sorted(set(body) - known)
  if unknown:
    raise ApiError(400, f"unknown parameter {unknown[0]!r}", unknown[0], "unknown_parameter")
  mt_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
  max_tokens = number(body, mt_key, 1, max_tokens_limit, min(max_tokens_default, max_tokens_limit),
                    (int,))
  temperature = number(body, "temperature", 0, 2, 1.0)
  top_p = number(body, "top_p", 0, 1, 1.0)
  if top_p == 0:
    raise ApiError(400, "top_p must be > 0", "top_p")
  top_k = number(body, "top_k", -1, 1 << 20, 0, (int,))
  n = number(body, "n", 1, max_n, 1, (int,))
  seed = seed_field(body)
  stop = body.get("stop")
  if stop is None:
    stop = ()
  elif isinstance(stop, str) and stop:
    stop = (stop,)
  elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
    stop = tuple(stop)
  else:
    raise ApiError(400, "stop must be a non-empty string or a list of up to 4 of them", "stop")
  stream = body.get("stream", False) or False
  if not isinstance(stream, bool):
    raise ApiError(400, "stream must be a boolean", "stream")
  opts = body.get("stream_options") or {}
  include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
  logprobs = body.get("logprobs", False)
  if chat:
    if logprobs is None:
      logprobs = False
    if not isinstance(logprobs, bool):
      raise ApiError(400, "logprobs must be a boolean", "logprobs")
    top_logprobs = number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0, (int,))
    if top_logprobs and not logprobs:
      raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
  else:  # completions: logprobs is an integer count of alternatives; we return the sampled one
    if logprobs not in (None, False, 0, 1) and not (isinstance(logprobs, int) and logprobs >= 0):
      raise ApiError(400, "logprobs must be a non-negative integer", "logprobs")
    if isinstance(logprobs, int) and logprobs > 1:
      raise ApiError(400, f"logprobs={logprobs}: only the sampled token's log-prob is served "
                     "(use 0 or 1)", "logprobs", "unsupported_parameter")
    logprobs = logprobs is not None and logprobs is not False
    if body.get("top_logprobs") not in (None, 0):
      raise ApiError(400, "top_logprobs is a chat parameter", "top_logprobs")
    top_logprobs = 0
  tools = body.get("tools")
  if tools is not None:
    if not chat:
      raise ApiError(400, "tools are a chat parameter", "tools")
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str) for t in tools):
      raise ApiError(400, "tools must be a list of {type: function, function: {name, ...}}",
                     "tools")
  tool_choice, tool_name = tool_choice_field(body.get("tool_choice"), tools)
  parallel = body.get("parallel_tool_calls")
  if parallel is not None and not isinstance(parallel, bool):
    raise ApiError(400, "parallel_tool_calls must be a boolean", "parallel_tool_calls")
  response_format = response_format_field(body.get("response_format"))
  if chat:
    if "messages" not in body:
      raise ApiError(400, "messages is required", "messages")
    prompt = None
  else:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]
    if isinstance(prompt, list):
      if not prompt or not all(isinstance(t, int) and not isinstance(t, bool)
                               and 0 <= t < vocab_size for t in prompt):
        raise ApiError(400, f"prompt must be a string or one list of token ids in "
                       f"[0, {vocab_size})", "prompt")
    elif not isinstance(prompt, str) or not prompt:
      raise ApiError(400, "prompt must be a non-empty string or one list of token ids",
                     "prompt")
  sampling = SamplingParams(max_tokens=max_tokens, temperature=float(temperature),
                            top_p=float(top_p), top_k=max(int(top_k), 0),
                            stop_token_ids=tuple(stop_token_ids), top_logprobs=top_logprobs,
                            response_format=response_format)
  return Request(model, sampling, n, seed, stop, stream, include_usage, logprobs,
                 tools, tool_choice, body.get("messages"), prompt, tool_name,
                 parallel is not False)


def truncate_at_stop(ids: list[int], decode, stops: tuple[str, ...]) -> Optional[tuple[int, int]]:
  """Where the first stop string appears in the decoded ids: (tokens to keep, characters of
  text before the stop string), or None. The kept tokens are the fewest whose text contains
  the stop string (what the model sampled to write it); the client sees the text before it."""
  if not stops:
    return None
  text = decode(ids)
  hits = [(text.find(s), s) for s in stops if s in text]
  if not hits:
    return None
  pos, s = min(hits)
  lo, hi = 1, len(ids)
  while lo < hi:                  # fewest tokens whose text reaches past the stop string
    mid = (lo + hi) // 2
    if len(decode(ids[:mid])) >= pos + len(s):
      hi = mid
    else:
      lo = mid + 1
  return lo, pos


def token_logprobs(tokens: list[str], logprobs: list[float],
                   tops: Optional[list[list[tuple[str, float]]]] = None) -> dict[str, Any]:
  """The chat `logprobs` object: per sampled token its text, bytes and log-prob, and (`tops`,
  per token) the most likely tokens' texts and log-probs, most likely first."""
  def entry(t: str, lp: float) -> dict[str, Any]:
    return {"token": t, "logprob": lp, "bytes": list(t.encode())}
  return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, x) for a, x in
                                                        (tops[i] if tops else ())]}
                      for i, (t, lp) in enumerate(zip(tokens, logprobs))], "refusal": None}


def fingerprint(version: int) -> str:
  """`system_fingerprint`: which policy version sampled the answer."""
  return f"posttrain_jax-v{version}"


def chat_response(call_id: str, model: str, choices: list[dict], usage: dict,
                  version: int) -> dict:
  return {"id": call_id, "object": "chat.completion", "created": int(time.time()), "model": model,
          "choices": choices, "usage": usage, "system_fingerprint": fingerprint(version)}


def chunk(call_id: str, model: str, created: int, choices: list[dict], usage=None,
          version: Optional[int] = None) -> str:
  body = {"id": call_id, "object": "chat.completion.chunk", "created": created, "model": model,
          "choices": choices}
  if version is not None:
    body["system_fingerprint"] = fingerprint(version)
  if usage is not None:
    body["usage"] = usage
  return f"data: {json.dumps(body)}\n\n"
