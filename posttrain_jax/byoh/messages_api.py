"""Anthropic's Messages API (`POST /v1/messages`) as chat messages, and its answers and events.

A request becomes the chat a Chat Completions harness would send for the same conversation
(dialects.py says why):

    system: "text" | [{type: text, text}]   -> a system message, first (blocks joined)
    {role: user, content: "text"}           -> a user message
    user blocks: text / tool_result         -> in order: a user message per run of text blocks,
                 {tool_use_id, content,        a tool message per tool_result (its content a
                  is_error}                    string or text blocks; `is_error: true` kept as
                                               the message's is_error: no chat template shows
                                               it, the record and triage count it)
    assistant blocks: text / tool_use       -> one assistant message: the text, and a tool call
                 {id, name, input}             per tool_use (arguments: the input as JSON)
    tools: {name, description, input_schema}
                                            -> {type: function, function: {name, description,
                                                parameters}}

`max_tokens` is required; `stop_sequences`, `temperature` (0..1), `top_p`, `top_k` and
`tool_choice` {type: auto | none | any | tool (name)} with `disable_parallel_tool_use` are
honoured (any / tool as the chat route's "required" / a named function: tool_choice.py,
a prefilled call drawn again until met, else a 422); `seed` is ours (sampling is then reproducible,
streamed or not). A final assistant message (a prefill) is refused: the chat template would
close that turn, not continue it. Callers send their key as `x-api-key` (or `Authorization:
Bearer`; the same keys and tenants as the other dialects) and must send `anthropic-version`.

The answer is a message: `content` blocks (a text block, and a tool_use block per tool call the
model wrote, parsed as the chat route parses them), `stop_reason` ("end_turn", "max_tokens",
"stop_sequence" with the `stop_sequence` met, "tool_use") and `usage` {input_tokens,
output_tokens}. Streams send Anthropic's events: message_start, per block content_block_start /
content_block_delta (text_delta, input_json_delta) / content_block_stop, message_delta (stop
reason, output tokens), message_stop; a failure mid-stream sends an `error` event. Errors are
`{"type": "error", "error": {"type", "message"}}`, the type from the status (error_body).
"""
from __future__ import annotations

import json
from typing import Any, Optional

from posttrain_jax.byoh import dialects
from posttrain_jax.byoh import openai_api as api
from posttrain_jax.engines.base import SamplingParams

PREFIX = "msg_"
MAX_TOKENS_FIELD = "max_tokens"

# Accepted and ignored: they change nothing we do (caching, routing, attribution).
_IGNORED = {"metadata", "service_tier", "cache_control", "inference_geo", "speed",
            "user_profile_id", "workspace_id"}
_KNOWN = {"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p",
          "top_k", "stream", "tools", "tool_choice", "seed", *_IGNORED}
_NOOP = {"thinking": {"type": "disabled"}}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 529: "overloaded_error"}


def error_body(e: api.ApiError) -> dict[str, Any]:
  """An ApiError in Anthropic's shape (the field it names, if any, in the message)."""
  kind = _ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
  message = e.message if not e.param or e.param in e.message else f"{e.param}: {e.message}"
  return {"type": "error", "error": {"type": kind, "message": message}}


def _block_type(block: Any, param: str, kinds: tuple[str, ...]) -> str:
  kind = block.get("type") if isinstance(block, dict) else type(block).__name__
  if kind not in kinds:
    raise api.ApiError(400, f"content block of type {kind!r} is not supported here (valid: "
                       f"{', '.join(kinds)})", f"{param}.type")
  return kind


def _string(block: dict, key: str, param: str) -> str:
  if not isinstance(block.get(key), str):
    raise api.ApiError(400, f"{key} is required (a string)", f"{param}.{key}")
  return block[key]


def _text(content: Any, param: str) -> str:
  """A string, or text blocks joined (the system prompt, a tool result)."""
  if isinstance(content, str):
    return content
  if not isinstance(content, list):
    raise api.ApiError(400, "must be a string or a list of text blocks", param)
  for i, b in enumerate(content):
    _block_type(b, f"{param}[{i}]", ("text",))
  return "".join(_string(b, "text", f"{param}[{i}]") for i, b in enumerate(content))


def _assistant(blocks: list, p: str) -> dict[str, Any]:
  text, calls = [], []
  for k, b in enumerate(blocks):
    q = f"{p}.content[{k}]"
    if _block_type(b, q, ("text", "tool_use")) == "text":
      text.append(_string(b, "text", q))
      continue
    if not isinstance(b.get("input"), dict):
      raise api.ApiError(400, "input must be an object", f"{q}.input")
    calls.append({"id": _string(b, "id", q), "type": "function", "function": {
        "name": _string(b, "name", q), "arguments": json.dumps(b["input"])}})
  msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
  if calls:
    msg["tool_calls"] = calls
  return msg


def _user(blocks: list, p: str) -> list[dict[str, Any]]:
  out: list[dict[str, Any]] = []
  for k, b in enumerate(blocks):
    q = f"{p}.content[{k}]"
    if _block_type(b, q, ("text", "tool_result")) == "text":
      if out and out[-1]["role"] == "user":
        out[-1]["content"] += _string(b, "text", q)
      else:
        out.append({"role": "user", "content": _string(b, "text", q)})
    else:
      content = b.get("content")
      msg = {"role": "tool", "tool_call_id": _string(b, "tool_use_id", q),
             "content": "" if content is None else _text(content, f"{q}.content")}
      if b.get("is_error") is not None and not isinstance(b["is_error"], bool):
        raise api.ApiError(400, "is_error must be a boolean", f"{q}.is_error")
      if b.get("is_error"):
        msg["is_error"] = True
      out.append(msg)
  return out


def chat_messages(messages: Any) -> list[dict[str, Any]]:
  """`messages` as chat messages (module docstring); ApiError naming the block otherwise."""
  if not isinstance(messages, list) or not messages:
    raise api.ApiError(400, "messages must be a non-empty list", "messages")
  out: list[dict[str, Any]] = []
  for i, m in enumerate(messages):
    p = f"messages[{i}]"
    if not isinstance(m, dict):
      raise api.ApiError(400, "a message must be an object", p)
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant"):
      raise api.ApiError(400, f"role {role!r}; valid: user, assistant (the system prompt is "
                         "the top-level `system`)", f"{p}.role")
    if isinstance(content, str):
      out.append({"role": role, "content": content})
    elif isinstance(content, list) and content:
      out += [_assistant(content, p)] if role == "assistant" else _user(content, p)
    else:
      raise api.ApiError(400, "content must be a string or a non-empty list of blocks",
                         f"{p}.content")
  if messages[-1]["role"] == "assistant":
    raise api.ApiError(400, "a final assistant message (a prefill) is not supported: end "
                       "with a user message", f"messages[{len(messages) - 1}]")
  return out


def chat_tools(tools: Any) -> Optional[list[dict[str, Any]]]:
  """Anthropic's tools in the Chat Completions form; None for none."""
  out = []
  for i, t in enumerate(dialects.tool_list(tools)):
    p = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "custom") != "custom":
      kind = t.get("type") if isinstance(t, dict) else type(t).__name__
      raise api.ApiError(400, f"tool type {kind!r} is not supported (client tools with an "
                         "input_schema only)", f"{p}.type")
    if not isinstance(t.get("input_schema"), dict):
      raise api.ApiError(400, "input_schema is required (a JSON schema object)",
                         f"{p}.input_schema")
    out.append(dialects.chat_tool(t.get("name"), t.get("description"), t["input_schema"], p))
  return out or None


def _tool_choice(v: Any, tools) -> tuple[str, Optional[str], bool]:
  """Anthropic's tool_choice as the chat request's (mode, tool name, parallel tool calls)."""
  if v is None:
    return "auto", None, True
  if isinstance(v, str):             # the type alone, as earlier versions took it
    v = {"type": v}
  kind = v.get("type") if isinstance(v, dict) else None
  if kind not in ("auto", "none", "any", "tool"):
    raise api.ApiError(400, f"tool_choice={json.dumps(v)}; valid types: auto, none, any, tool",
                       "tool_choice.type")
  if not isinstance(v.get("disable_parallel_tool_use", False), bool):
    raise api.ApiError(400, "disable_parallel_tool_use must be a boolean",
                       "tool_choice.disable_parallel_tool_use")
  parallel = not v.get("disable_parallel_tool_use", False)
  if kind in ("auto", "none"):
    return kind, None, parallel
  name = None
  if kind == "tool":
    name = v.get("name")
    if not isinstance(name, str) or not name:
      raise api.ApiError(400, "tool_choice of type tool needs a name", "tool_choice.name")
  mode, name = api.check_forced_tool("required", name, tools, "tool_choice", "tool_choice.name")
  return mode, name, parallel


def parse(proxy, body: Any, tenant: str, headers) -> tuple[api.Request, None]:
  """The request as a chat request (module docstring)."""
  if not headers.get("anthropic-version"):
    raise api.ApiError(400, "the anthropic-version header is required", "anthropic-version")
  cfg = proxy.cfg
  model = dialects.check_body(body, (cfg.model_name,), _KNOWN, _NOOP)
  if body.get("max_tokens") is None:
    raise api.ApiError(400, "max_tokens is required", "max_tokens")
  max_tokens = api.number(body, "max_tokens", 1, cfg.max_tokens_limit, None, (int,))
  temperature = api.number(body, "temperature", 0, 1, 1.0)
  top_p = api.number(body, "top_p", 0, 1, 1.0)
  if top_p == 0:
    raise api.ApiError(400, "top_p must be > 0", "top_p")
  top_k = api.number(body, "top_k", 0, 1 << 20, 0, (int,))
  seed = api.seed_field(body)
  stream = dialects.flag(body, "stream", False)
  stop = body.get("stop_sequences") or []
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
    raise api.ApiError(400, "stop_sequences must be a list of non-empty strings",
                       "stop_sequences")
  system = _text(body["system"], "system") if body.get("system") is not None else ""
  tools = chat_tools(body.get("tools"))
  tool_choice, tool_name, parallel = _tool_choice(body.get("tool_choice"), tools)
  if "messages" not in body:
    raise api.ApiError(400, "messages is required", "messages")
  messages = ([{"role": "system", "content": system}] if system else []) + chat_messages(
      body["messages"])
  sampling = SamplingParams(max_tokens=max_tokens, temperature=float(temperature),
                            top_p=float(top_p), top_k=int(top_k), stop_token_ids=proxy.stop_ids)
  return api.Request(model, sampling, 1, seed, tuple(stop), stream, False, False, tools,
                     tool_choice, messages, None, tool_name, parallel), None


# -- the answer -------------------------------------------------------------------------------


def _stop(proxy, req: api.Request, choice) -> tuple[str, Optional[str]]:
  """(stop_reason, stop_sequence) of a choice."""
  if choice.message.get("tool_calls"):
    return "tool_use", None
  if choice.finish_reason == "length":
    return "max_tokens", None
  ids = choice.token_ids
  if req.stop and not (ids and ids[-1] in proxy.stop_ids):   # cut by a stop string
    after = proxy.builder.decode(ids)[len(choice.text):]
    hits = [(after.find(s), s) for s in req.stop if s in after]
    if hits:
      return "stop_sequence", min(hits)[1]
  return "end_turn", None


def response(proxy, call_id: str, body: dict, req: api.Request, prompt, choice,
             created: int) -> dict[str, Any]:
  """The message of a completed call."""
  msg = choice.message
  calls = msg.get("tool_calls") or []
  content = []
  if msg.get("content") or not calls:
    content.append({"type": "text", "text": msg.get("content") or ""})
  for tc in calls:
    content.append({"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"],
                    "input": json.loads(tc["function"]["arguments"])})
  reason, sequence = _stop(proxy, req, choice)
  return {"id": call_id, "type": "message", "role": "assistant", "model": req.model,
          "content": content, "stop_reason": reason, "stop_sequence": sequence,
          "usage": {"input_tokens": len(prompt.ids), "output_tokens": len(choice.token_ids)}}


class Events:
  """A streamed message's events (module docstring)."""

  def __init__(self, call_id: str, body: dict, req: api.Request, prompt, created: int):
    self.call_id, self.model, self.n_prompt = call_id, req.model, len(prompt.ids)
    self.opened = False             # the text block was started

  @staticmethod
  def _ev(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

  def start(self) -> list[str]:
    return [self._ev("message_start", message={
        "id": self.call_id, "type": "message", "role": "assistant", "model": self.model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": self.n_prompt, "output_tokens": 0}})]

  def _open(self) -> list[str]:
    self.opened = True
    return [self._ev("content_block_start", index=0,
                     content_block={"type": "text", "text": ""})]

  def text(self, piece: str) -> list[str]:
    out = [] if self.opened else self._open()
    return out + [self._ev("content_block_delta", index=0,
                           delta={"type": "text_delta", "text": piece})]

  def finish(self, resp: dict[str, Any]) -> list[str]:
    out = []
    for i, block in enumerate(resp["content"]):
      if block["type"] == "text":
        out += [] if self.opened else self._open()
      else:
        out += [self._ev("content_block_start", index=i, content_block={**block, "input": {}}),
                self._ev("content_block_delta", index=i, delta={
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"])})]
      out.append(self._ev("content_block_stop", index=i))
    return out + [
        self._ev("message_delta", delta={"stop_reason": resp["stop_reason"],
                                         "stop_sequence": resp["stop_sequence"]},
                 usage={"output_tokens": resp["usage"]["output_tokens"]}),
        self._ev("message_stop")]

  def error(self, err: api.ApiError) -> list[str]:
    return [f"event: error\ndata: {json.dumps(error_body(err))}\n\n"]
