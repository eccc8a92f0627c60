"""The OpenAI request fields we serve, validated, and the response bodies we send back.

A request is read field by field (not by a schema library) so that each mistake is one 400
with an OpenAI-style body naming the field: `{"error": {"message", "type", "param", "code"}}`.
Fields the engines cannot honour (penalties, logit bias, top_logprobs, forced tool choice) are
refused with a message that says so, rather than silently ignored.
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

  def body(self) -> dict[str, Any]:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code}}


# Accepted and ignored (they change nothing we do), or accepted only at their no-op value.
_IGNORED = {"user", "metadata", "store", "parallel_tool_calls", "stream_options", "service_tier",
            "reasoning_effort", "modalities", "prediction", "functions", "function_call", "name"}
_NOOP = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "top_logprobs": 0,
         "echo": False, "suffix": None, "best_of": 1, "response_format": None}


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
  tool_choice: str                # "auto" | "none"
  messages: Any = None            # chat: the raw messages (prompts.normalize_messages reads them)
  prompt: Any = None              # completions: a string or a list of token ids


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
    if v is not None and v != noop and not (key == "response_format" and v == {"type": "text"}):
      raise ApiError(400, f"{key}={v!r} is not supported by this server (the engines sample "
                     f"plain log-probs only)", key, "unsupported_parameter")
  known = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
           "top_p", "n", "seed", "stop", "stream", "logprobs", "tools", "tool_choice", "top_k",
           *_IGNORED, *_NOOP}
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
  elif isinstance(stop, str):
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
  else:  # completions: logprobs is an integer count of alternatives; we return the sampled one
    if logprobs not in (None, False, 0, 1) and not (isinstance(logprobs, int) and logprobs >= 0):
      raise ApiError(400, "logprobs must be a non-negative integer", "logprobs")
    if isinstance(logprobs, int) and logprobs > 1:
      raise ApiError(400, f"logprobs={logprobs}: only the sampled token's log-prob is served "
                     "(use 0 or 1)", "logprobs", "unsupported_parameter")
    logprobs = logprobs is not None and logprobs is not False
  tools, tool_choice = body.get("tools"), body.get("tool_choice")
  if tools is not None:
    if not chat:
      raise ApiError(400, "tools are a chat parameter", "tools")
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str) for t in tools):
      raise ApiError(400, "tools must be a list of {type: function, function: {name, ...}}",
                     "tools")
  if tool_choice is None:
    tool_choice = "auto"
  if tool_choice not in ("auto", "none"):
    raise ApiError(400, f"tool_choice={json.dumps(tool_choice)} needs constrained decoding, "
                   "which this server does not do; use 'auto' or 'none'", "tool_choice",
                   "unsupported_parameter")
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
                            stop_token_ids=tuple(stop_token_ids))
  return Request(model, sampling, n, seed, stop, stream, include_usage, logprobs,
                 tools, tool_choice, body.get("messages"), prompt)


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


def token_logprobs(tokens: list[str], logprobs: list[float]) -> dict[str, Any]:
  """The chat `logprobs` object: per sampled token its text, bytes and log-prob."""
  return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                      for t, lp in zip(tokens, logprobs)], "refusal": None}


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
