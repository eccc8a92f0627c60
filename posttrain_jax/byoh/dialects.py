"""Serving a call in a dialect other than Chat Completions: the Responses API (responses_api.py)
and Anthropic's Messages API (messages_api.py), plus the request checks they share.

A dialect module turns its request into the same `openai_api.Request` a chat call makes -- chat
messages and tools in the Chat Completions form -- so the call is rendered by the same chat
template, spliced onto the session's earlier calls by the same rules (prompts.py) and recorded
in the same trace store as a "chat" call. A session may mix dialects: only the request body kept
with the call (and the call id's prefix) says which one it spoke. A dialect module provides:

    PREFIX                                     its call ids' prefix ("resp_", "msg_")
    MAX_TOKENS_FIELD                           its name of max_tokens (a 400 names it)
    parse(proxy, body, tenant, headers)        -> (Request, session of the call it continues
                                                  or None); ApiError (4xx) naming the field
    response(proxy, call_id, body, req, prompt, choice, created) -> the response body
    Events(call_id, body, req, prompt, created) its stream's server-sent events:
      .start() / .text(piece) / .finish(response) / .error(ApiError) -> lists of events

`serve` runs one call as app.py's chat route does: validate (nothing recorded on a 4xx), prompt,
record, generate, answer, record the end; a client that leaves early leaves the call
"incomplete", an engine failure is a 503 and an "error" call. Only `n = 1`: neither API has
choices. A stream sends the text while it is sampled where the chat route would (the engine
streams, no tool calls to parse first), else once decoded; tool calls are sent whole.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Optional

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from posttrain_jax.byoh import openai_api as api
from posttrain_jax.engines.base import EngineError

# -- request checks shared by the dialects ----------------------------------------------------


def check_body(body: Any, models: tuple[str, ...], known: set[str],
               noop: dict[str, Any]) -> str:
  """The body is an object naming a served model, with no unknown field and every `noop`
  field at its no-op value; returns the model. ApiError naming the field otherwise."""
  if not isinstance(body, dict):
    raise api.ApiError(400, "the request body must be a JSON object")
  model = body.get("model")
  if not isinstance(model, str) or not model:
    raise api.ApiError(400, "model is required (a string)", "model")
  if model not in models:
    raise api.ApiError(404, f"the model {model!r} does not exist; served: {', '.join(models)}",
                       "model", "model_not_found")
  unknown = sorted(set(body) - known - set(noop))
  if unknown:
    raise api.ApiError(400, f"unknown parameter {unknown[0]!r}", unknown[0], "unknown_parameter")
  for key, value in noop.items():
    if body.get(key) not in (None, value):
      raise api.ApiError(400, f"{key}={body[key]!r} is not supported by this server", key,
                         "unsupported_parameter")
  return model


def flag(body: dict, key: str, default: bool) -> bool:
  """`body[key]`, a boolean (`default` when absent or null)."""
  v = body.get(key)
  if v is None:
    return default
  if not isinstance(v, bool):
    raise api.ApiError(400, f"{key} must be a boolean", key)
  return v


def text_field(body: dict, key: str) -> Optional[str]:
  v = body.get(key)
  if v is not None and not isinstance(v, str):
    raise api.ApiError(400, f"{key} must be a string", key)
  return v


def tool_list(tools: Any) -> list:
  """A request's `tools`: [] when absent or null, else the list itself; ApiError otherwise."""
  if tools is None:
    return []
  if not isinstance(tools, list):
    raise api.ApiError(400, "tools must be a list", "tools")
  return tools


def chat_tool(name: Any, description: Any, parameters: Any, param: str) -> dict[str, Any]:
  """A function tool in the Chat Completions form (what the chat template renders)."""
  if not isinstance(name, str) or not name:
    raise api.ApiError(400, "a tool needs a name (a non-empty string)", f"{param}.name")
  fn: dict[str, Any] = {"name": name}
  if description is not None:
    if not isinstance(description, str):
      raise api.ApiError(400, "a tool's description must be a string", f"{param}.description")
    fn["description"] = description
  if parameters is not None:
    if not isinstance(parameters, dict):
      raise api.ApiError(400, "a tool's JSON schema must be an object", param)
    fn["parameters"] = parameters
  return {"type": "function", "function": fn}


# -- serving ----------------------------------------------------------------------------------


async def serve(proxy, request: HttpRequest, dialect, body: Any, tenant: str, session: str,
                fresh: bool):
  """One call of `dialect` (module docstring); `fresh`: the session was made for this call
  (no session header or key), so a call it continues lends it its session."""
  req, continued = dialect.parse(proxy, body, tenant, request.headers)
  if fresh and continued:
    session = continued
  await proxy.gate.admit(tenant, session)   # the learner behind: a 429 or a wait
  _, messages, prompt = proxy.prepare(req, tenant, session,
                                     dialect.MAX_TOKENS_FIELD)
  call_id = f"{dialect.PREFIX}{uuid.uuid4().hex}"
  proxy.begin(call_id, "chat", tenant, session, body, messages, req, prompt)
  created = int(time.time())
  end = dict(call_id=call_id, tenant=tenant, session=session, t0=time.perf_counter(),
             kind="chat", messages=messages, tools=req.tools)
  headers = {"X-Session-Id": session}
  if req.stream:
    events = dialect.Events(call_id, body, req, prompt, created)
    return StreamingResponse(_stream(proxy, dialect, body, req, prompt, end, events, created),
                             headers=headers, media_type="text/event-stream")
  try:
    (choice,) = await proxy.sample(req, prompt, True, end, body)
  except api.ApiError as e:
    proxy.end_failed(e, **end)
    raise
  except EngineError as e:
    proxy.end(status="error", reason=str(e), **end)
    raise _engine_error(e) from None
  except asyncio.CancelledError:
    proxy.end(status="incomplete", reason="client_disconnected", **end)
    raise
  resp = dialect.response(proxy, call_id, body, req, prompt, choice, created)
  headers["X-Policy-Version"] = str(choice.version)
  status = "incomplete" if await request.is_disconnected() else "complete"
  proxy.end(status=status, choices=[choice], response=resp, prompt=prompt,
            reason="client_disconnected" if status == "incomplete" else None, **end)
  return JSONResponse(resp, headers=headers)


def _engine_error(e: Exception) -> api.ApiError:
  return api.ApiError(503, f"the engine failed: {e}", None, "engine_error", "server_error")


async def _stream(proxy, dialect, body, req: api.Request, prompt, end: dict, events,
                  created: int):
  """The SSE body of a streamed call; records how it ended (as app._stream does for chat)."""
  ended = False
  try:
    for ev in events.start():
      yield ev
    live = proxy.streams_tokens(req, True)
    text = proxy.text_so_far()
    try:
      if live:
        async for part in proxy.stream_generate(req, prompt):
          comps = part
          piece, _ = text.feed(part[0].token_ids, part[0].logprobs, req.stop)
          for ev in events.text(piece) if piece else ():
            yield ev
        choice = proxy.choice(0, comps[0], req, end["call_id"], True)
      else:
        (choice,) = await proxy.sample(req, prompt, True, end, body)
    except (api.ApiError, EngineError) as e:
      err = e if isinstance(e, api.ApiError) else _engine_error(e)
      proxy.end_failed(err, **end)
      ended = True
      for ev in events.error(err):
        yield ev
      return
    content = choice.message.get("content") or ""
    if choice.message.get("tool_calls"):   # parsed from the whole text: sent whole
      piece = content
    else:
      piece = "" if live else text.feed(choice.token_ids, choice.logprobs, req.stop)[0]
      rest = text.rest(content)
      if rest is None:
        proxy.counts["stream_text_mismatch"] += 1
        rest = ""
      piece += rest
    for ev in events.text(piece) if piece else ():
      yield ev
    resp = dialect.response(proxy, end["call_id"], body, req, prompt, choice, created)
    *rest_events, last = events.finish(resp)
    for ev in rest_events:
      yield ev
    # recorded before the last event: a client that has read it finds the call complete
    proxy.end(status="complete", choices=[choice], response=resp, prompt=prompt, **end)
    ended = True
    yield last
  finally:
    if not ended:  # the client left (or the proxy is stopping) before the stream ended
      proxy.end(status="incomplete", reason="client_disconnected", **end)
