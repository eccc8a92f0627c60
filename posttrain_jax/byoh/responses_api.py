"""The OpenAI Responses API (`POST /v1/responses`) as chat messages, and its answers and events.

A request becomes the chat a Chat Completions harness would send for the same conversation
(dialects.py says why):

    instructions                        -> a system message, first
    input: "text"                       -> a user message
    {type: message, role, content}      -> that message (developer is system; a string, or
                                           input_text / output_text parts joined)
    {type: function_call, call_id, name, arguments}
                                        -> a tool call of the assistant message just before it
                                           (else of a new assistant message)
    {type: function_call_output, call_id, output}
                                        -> a tool message
    tools: {type: function, name, description, parameters}
                                        -> {type: function, function: {name, description,
                                            parameters}}
    previous_response_id                -> that response's chat and its answer before `input`;
                                           its instructions are not carried over (as the API
                                           does). It must be the same tenant's, stored
                                           (store=true, the default) and completed: another
                                           tenant's reads as 404, like one that never existed.

The answer is `output` items: a `message` with one `output_text` part, and a `function_call`
item (call_id, name, arguments) per tool call the model wrote, parsed as the chat route parses
them. `usage` counts the prompt's and the sampled tokens. A response cut by
`max_output_tokens` is `status: "incomplete"`. Streams send `response.created`,
`response.in_progress`, per item `response.output_item.added`, its content
(`response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`, or `response.function_call_arguments.delta` / `.done`),
`response.output_item.done`, then `response.completed`; a failure mid-stream sends `error` and
`response.failed`. `tool_choice` "auto" | "none" | "required" | {type: function, name} and
`parallel_tool_calls` are served as the chat route serves them (tool_choice.py: a forced
call is prefilled and drawn again until met, else a 422). Beyond the API: `seed` (sampling is
then reproducible, streamed or not). Not served: structured `text.format` and `top_logprobs`.
Errors are `{"error": {"message", "type", "param", "code"}}` with a 4xx.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from posttrain_jax.byoh import dialects
from posttrain_jax.byoh import openai_api as api
from posttrain_jax.engines.base import SamplingParams

PREFIX = "resp_"
MAX_TOKENS_FIELD = "max_output_tokens"

# Accepted and ignored (they change nothing we do), or accepted only at their no-op value.
_IGNORED = {"metadata", "user", "truncation", "service_tier",
            "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "include",
            "reasoning", "stream_options", "max_tool_calls"}
_NOOP = {"background": False, "top_logprobs": 0, "conversation": None, "prompt": None}
_KNOWN = {"model", "input", "instructions", "tools", "tool_choice", "previous_response_id",
          "store", "stream", "max_output_tokens", "temperature", "top_p", "text", "seed",
          "parallel_tool_calls", *_IGNORED}
_TEXT_PARTS = ("input_text", "output_text")


def _text(content: Any, param: str) -> str:
  if isinstance(content, str):
    return content
  if not isinstance(content, list):
    raise api.ApiError(400, "content must be a string or a list of text parts", param)
  out = []
  for i, part in enumerate(content):
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
      raise api.ApiError(400, f"content part of type {kind!r} is not supported (text only: "
                         f"{', '.join(_TEXT_PARTS)})", f"{param}[{i}]", "unsupported_content")
    out.append(part["text"])
  return "".join(out)


def _string(item: dict, key: str, param: str) -> str:
  if not isinstance(item.get(key), str):
    raise api.ApiError(400, f"{key} is required (a string)", f"{param}.{key}")
  return item[key]


def input_messages(value: Any) -> list[dict[str, Any]]:
  """`input` as chat messages (module docstring); ApiError naming the item otherwise."""
  if isinstance(value, str):
    return [{"role": "user", "content": value}]
  if not isinstance(value, list) or not value:
    raise api.ApiError(400, "input must be a string or a non-empty list of items", "input")
  out: list[dict[str, Any]] = []
  for i, item in enumerate(value):
    p = f"input[{i}]"
    if not isinstance(item, dict):
      raise api.ApiError(400, "an input item must be an object", p)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
      role = item.get("role")
      if role not in ("user", "system", "developer", "assistant"):
        raise api.ApiError(400, f"role {role!r}; valid: user, system, developer, assistant",
                           f"{p}.role")
      out.append({"role": "system" if role == "developer" else role,
                  "content": _text(item.get("content"), f"{p}.content")})
    elif kind == "function_call":
      call = {"id": _string(item, "call_id", p), "type": "function",
              "function": {"name": _string(item, "name", p),
                           "arguments": _string(item, "arguments", p)}}
      if out and out[-1]["role"] == "assistant":   # the same turn: text, then its calls
        out[-1].setdefault("tool_calls", []).append(call)
      else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
      out.append({"role": "tool", "tool_call_id": _string(item, "call_id", p),
                  "content": _text(item.get("output"), f"{p}.output")})
    else:
      raise api.ApiError(400, f"input item of type {kind!r} is not supported (message, "
                         "function_call, function_call_output)", f"{p}.type",
                         "unsupported_input_item")
  return out


def chat_tools(tools: Any) -> Optional[list[dict[str, Any]]]:
  """Responses' flat function tools in the Chat Completions form; None for none."""
  out = []
  for i, t in enumerate(dialects.tool_list(tools)):
    kind = t.get("type") if isinstance(t, dict) else type(t).__name__
    if kind != "function":
      raise api.ApiError(400, f"tool type {kind!r} is not supported (function tools only)",
                         f"tools[{i}].type", "unsupported_tool")
    out.append(dialects.chat_tool(t.get("name"), t.get("description"), t.get("parameters"),
                                  f"tools[{i}]"))
  return out or None


def _previous(proxy, prev: Any, tenant: str) -> tuple[list[dict[str, Any]], str]:
  """The chat and answer of the tenant's stored response `prev`, and its session."""
  if not isinstance(prev, str) or not prev:
    raise api.ApiError(400, "previous_response_id must be a non-empty string",
                       "previous_response_id")
  call = proxy.store.call(prev, tenant) if prev.startswith(PREFIX) else None
  if call is None or call.request.get("store") is False:
    raise api.ApiError(404, f"Previous response with id {prev!r} not found.",
                       "previous_response_id", "previous_response_not_found")
  if call.status != "complete" or not call.choices:
    raise api.ApiError(400, f"previous response {prev!r} did not complete ({call.status}); "
                       "only a completed response can be continued", "previous_response_id")
  messages = list(call.messages or [])
  if call.request.get("instructions"):   # its system message: not carried over
    messages = messages[1:]
  return messages + [call.choices[0].message], call.session


def parse(proxy, body: Any, tenant: str, headers) -> tuple[api.Request, Optional[str]]:
  """The request as a chat request (module docstring), and the session of the response it
  continues (None without previous_response_id)."""
  cfg = proxy.cfg
  model = dialects.check_body(body, (cfg.model_name,), _KNOWN, _NOOP)
  limit = cfg.max_tokens_limit
  max_tokens = api.number(body, "max_output_tokens", 1, limit,
                          min(cfg.max_tokens_default, limit), (int,))
  temperature = api.number(body, "temperature", 0, 2, 1.0)
  top_p = api.number(body, "top_p", 0, 1, 1.0)
  if top_p == 0:
    raise api.ApiError(400, "top_p must be > 0", "top_p")
  seed = api.seed_field(body)
  stream = dialects.flag(body, "stream", False)
  dialects.flag(body, "store", True)
  instructions = dialects.text_field(body, "instructions")
  text = body.get("text")
  fmt = text.get("format") if isinstance(text, dict) else None
  if text is not None and (not isinstance(text, dict) or fmt not in (None, {"type": "text"})):
    raise api.ApiError(400, f"text={json.dumps(text)}: only plain text output is served "
                       "(structured outputs need constrained decoding)", "text",
                       "unsupported_parameter")
  tools = chat_tools(body.get("tools"))
  tool_choice, tool_name = _tool_choice(body.get("tool_choice"), tools)
  parallel = dialects.flag(body, "parallel_tool_calls", True)
  if "input" not in body:
    raise api.ApiError(400, "input is required", "input")
  messages = input_messages(body["input"])
  history, session = [], None
  if body.get("previous_response_id") is not None:
    history, session = _previous(proxy, body["previous_response_id"], tenant)
  system = [{"role": "system", "content": instructions}] if instructions else []
  sampling = SamplingParams(max_tokens=max_tokens, temperature=float(temperature),
                            top_p=float(top_p), top_k=0, stop_token_ids=proxy.stop_ids)
  req = api.Request(model, sampling, 1, seed, (), stream, False, False, tools, tool_choice,
                    system + history + messages, None, tool_name, parallel)
  return req, session


def _tool_choice(v: Any, tools) -> tuple[str, Optional[str]]:
  """The Responses API's tool_choice as the chat request's (mode, tool name)."""
  if v is None:
    return "auto", None
  if v in ("auto", "none", "required"):
    return api.check_forced_tool(v, None, tools, "tool_choice")
  if isinstance(v, dict) and v.get("type") == "function":
    if not isinstance(v.get("name"), str) or not v["name"]:
      raise api.ApiError(400, "a named tool_choice is {type: function, name}", "tool_choice.name")
    return api.check_forced_tool("required", v["name"], tools, "tool_choice", "tool_choice.name")
  raise api.ApiError(400, f"tool_choice={json.dumps(v)}; valid: 'auto', 'none', 'required' or "
                     "{type: function, name}", "tool_choice", "unsupported_parameter")


# -- the answer -------------------------------------------------------------------------------


def _envelope(call_id: str, body: dict, req: api.Request, created: int) -> dict[str, Any]:
  """The response object's fields that do not depend on the answer."""
  return {"id": call_id, "object": "response", "created_at": created, "error": None,
          "incomplete_details": None, "instructions": body.get("instructions"),
          "max_output_tokens": body.get("max_output_tokens"), "model": req.model,
          "parallel_tool_calls": req.parallel_tool_calls,
          "previous_response_id": body.get("previous_response_id"),
          "store": body.get("store") is not False, "temperature": req.sampling.temperature,
          "top_p": req.sampling.top_p, "text": {"format": {"type": "text"}},
          "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
          "truncation": "disabled", "metadata": body.get("metadata") or {}}


def _message_id(call_id: str) -> str:
  return "msg_" + call_id[len(PREFIX):]


def response(proxy, call_id: str, body: dict, req: api.Request, prompt, choice,
             created: int) -> dict[str, Any]:
  """The response object of a completed call."""
  msg = choice.message
  calls = msg.get("tool_calls") or []
  status = "incomplete" if choice.finish_reason == "length" else "completed"
  output = []
  if msg.get("content") or not calls:
    output.append({"id": _message_id(call_id), "type": "message", "role": "assistant",
                   "status": status, "content": [
                       {"type": "output_text", "text": msg.get("content") or "",
                        "annotations": [], "logprobs": []}]})
  for k, tc in enumerate(calls):
    output.append({"id": f"fc_{call_id[len(PREFIX):]}_{k}", "type": "function_call",
                   "status": "completed", "call_id": tc["id"], "name": tc["function"]["name"],
                   "arguments": tc["function"]["arguments"]})
  n_in, n_out = len(prompt.ids), len(choice.token_ids)
  return {**_envelope(call_id, body, req, created), "status": status, "output": output,
          "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
          else None,
          "usage": {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0},
                    "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": n_in + n_out}}


class Events:
  """A streamed response's events, numbered in order (module docstring)."""

  def __init__(self, call_id: str, body: dict, req: api.Request, prompt, created: int):
    self.base = _envelope(call_id, body, req, created)
    self.item_id = _message_id(call_id)
    self.seq = 0
    self.opened = False             # the message item was announced

  def _ev(self, kind: str, **fields) -> str:
    data = {"type": kind, "sequence_number": self.seq, **fields}
    self.seq += 1
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

  def _snapshot(self, status: str) -> dict[str, Any]:
    return {**self.base, "status": status, "output": [], "usage": None}

  def start(self) -> list[str]:
    return [self._ev("response.created", response=self._snapshot("in_progress")),
            self._ev("response.in_progress", response=self._snapshot("in_progress"))]

  def _part(self, kind: str, **fields) -> str:
    return self._ev(kind, item_id=self.item_id, output_index=0, content_index=0, **fields)

  def _open(self) -> list[str]:
    self.opened = True
    item = {"id": self.item_id, "type": "message", "role": "assistant",
            "status": "in_progress", "content": []}
    return [self._ev("response.output_item.added", output_index=0, item=item),
            self._part("response.content_part.added", part={
                "type": "output_text", "text": "", "annotations": [], "logprobs": []})]

  def text(self, piece: str) -> list[str]:
    out = [] if self.opened else self._open()
    return out + [self._part("response.output_text.delta", delta=piece, logprobs=[])]

  def finish(self, resp: dict[str, Any]) -> list[str]:
    out = []
    for i, item in enumerate(resp["output"]):
      if item["type"] == "message":
        if not self.opened:
          out += self._open()
        part = item["content"][0]
        out += [self._part("response.output_text.done", text=part["text"], logprobs=[]),
                self._part("response.content_part.done", part=part)]
      else:
        out += [
            self._ev("response.output_item.added", output_index=i,
                     item={**item, "arguments": "", "status": "in_progress"}),
            self._ev("response.function_call_arguments.delta", item_id=item["id"],
                     output_index=i, delta=item["arguments"]),
            self._ev("response.function_call_arguments.done", item_id=item["id"],
                     output_index=i, name=item["name"], arguments=item["arguments"])]
      out.append(self._ev("response.output_item.done", output_index=i, item=item))
    return out + [self._ev("response.completed", response=resp)]

  def error(self, err: api.ApiError) -> list[str]:
    failed = {**self._snapshot("failed"), "error": {"code": err.code or err.kind,
                                                    "message": err.message}}
    return [self._ev("error", code=err.code, message=err.message, param=err.param),
            self._ev("response.failed", response=failed)]
