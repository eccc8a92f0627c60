"""The FastAPI routes of the proxy (server.py has the serving logic) and `serve()`.

Every error a client can cause is a 4xx with an OpenAI-style body (Anthropic's on /v1/messages);
an unknown route is a 404 in the same shape; a call while the learner is behind (online) is a
429 with `Retry-After`, or waits (backpressure.py); only our own failures (the engine) are 5xx. A
forced `tool_choice` the model did not meet in any of the samples drawn (tool_choice.py) is
a 422 naming the field (code "tool_choice_unsatisfied"; not a 5xx, so clients do not retry on
their own what the proxy already retried), and unlike a 4xx the client caused, its samples are
recorded, as a "rejected" call. The Responses API and Anthropic's Messages API are served by
dialects.py.

Chat streaming answers are server-sent events: a role chunk at once, then the content, the tool
calls, a final chunk with the finish reasons, the usage chunk when `stream_options.include_usage`,
and `data: [DONE]`. The content is sent while it is sampled where the engine streams (`stream`: the
embedded sampler, a few decode steps at a time; stream_text.StreamText says which text is sure to stay),
else -- and when tool calls must first be parsed out of the whole text -- once decoded, a chunk per
token. A stream the client leaves early records its call as incomplete. The policy version that
answered is in `system_fingerprint` ("posttrain_jax-v<version>"; streams: the final chunk) and, for
whole answers, the `X-Policy-Version` header.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from posttrain_jax.byoh import dialects, json_text, messages_api, responses_api
from posttrain_jax.byoh import openai_api as api
from posttrain_jax.byoh.server import Proxy
from posttrain_jax.engines.base import EngineError
from posttrain_jax.errors import DiskWriteError


def _error(e: api.ApiError, request: Optional[Request] = None) -> JSONResponse:
  """`e` in the shape of the API the request spoke (Anthropic's on /v1/messages)."""
  if request is not None and request.url.path == "/v1/messages":
    return JSONResponse(messages_api.error_body(e), status_code=e.status, headers=e.headers)
  return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _json_body(request: Request, limit: int) -> Any:
  size = request.headers.get("content-length")
  if size is not None and size.isdigit() and int(size) > limit:
    raise api.ApiError(413, f"request body of {size} bytes; the limit is {limit}", None,
                       "request_too_large")
  raw = b""
  async for part in request.stream():
    raw += part
    if len(raw) > limit:
      raise api.ApiError(413, f"request body over {limit} bytes", None, "request_too_large")
  try:
    return json_text.loads(raw)
  except json_text.JsonTextError as e:  # not UTF-8 / JSON, too deep, a lone surrogate
    raise api.ApiError(400, f"the body is not valid JSON: {e}", e.field) from None


def build_app(proxy: Proxy) -> FastAPI:
  app = FastAPI(title="posttrain_jax recording proxy", docs_url=None, redoc_url=None)
  app.state.proxy = proxy
  limit = proxy.cfg.max_request_bytes

  @app.exception_handler(api.ApiError)
  async def _api_error(request, e: api.ApiError):
    return _error(e, request)

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(request, e: StarletteHTTPException):
    return _error(api.ApiError(e.status_code, str(e.detail), None, "not_found"
                               if e.status_code == 404 else None), request)

  @app.exception_handler(DiskWriteError)
  async def _disk(request, e: DiskWriteError):  # the store could not record: never a silent 200
    return _error(api.ApiError(507, str(e), None, "insufficient_storage", "server_error"),
                  request)

  @app.exception_handler(Exception)
  async def _bug(request, e: Exception):  # a bug of ours: still an API-shaped body, and a 500
    return _error(api.ApiError(500, f"internal error: {type(e).__name__}: {e}", None, None,
                               "server_error"), request)

  @app.get("/health")
  async def health():
    compiles = getattr(proxy.engine, "compiles", None)   # the embedded sampler's programs
    batched = [e.coalesce_stats() for e in (proxy.engine, *proxy.engines.values())
               if hasattr(e, "coalesce_stats")]            # ProxyConfig.coalesce_ms
    return {"status": "ok", "version": proxy.engine.version,
            "backpressure": proxy.gate.counters(),
            **({} if compiles is None else {"engine_compiles": int(compiles)}),
            **({"coalesced": {k: sum(b[k] for b in batched) for k in ("requests", "engine_calls")}}
               if batched else {})}

  @app.get("/v1/models")
  async def models(request: Request):
    proxy.tenant(request.headers)
    return {"object": "list", "data": [{"id": proxy.cfg.model_name, "object": "model",
                                        "created": 0, "owned_by": "posttrain_jax"}]}

  async def _complete(request: Request, chat: bool):
    tenant, session, _ = proxy.identity(request.headers)
    body = await _json_body(request, limit)
    req = proxy.parse(body, chat)
    await proxy.gate.admit(tenant, session)   # the learner behind: a 429 or a wait
    field = ("max_completion_tokens" if isinstance(body, dict)
             and body.get("max_completion_tokens") is not None else "max_tokens")
    call_id, messages, prompt = proxy.prepare(req, tenant, session, field)
    kind = "chat" if chat else "completion"
    proxy.begin(call_id, kind, tenant, session, body, messages, req, prompt)
    t0 = time.perf_counter()
    headers = {"X-Session-Id": session}
    end = dict(call_id=call_id, tenant=tenant, session=session, t0=t0, kind=kind,
               messages=messages, tools=req.tools)
    if req.stream:
      return StreamingResponse(_stream(proxy, req, prompt, end, chat, body), headers=headers,
                               media_type="text/event-stream")
    try:
      choices = await proxy.sample(req, prompt, chat, end, body)
    except api.ApiError as e:
      proxy.end_failed(e, **end)
      raise
    except EngineError as e:
      proxy.end(status="error", reason=str(e), **end)
      raise api.ApiError(503, f"the engine failed: {e}", None, "engine_error",
                         "server_error") from None
    except asyncio.CancelledError:
      proxy.end(status="incomplete", reason="client_disconnected", **end)
      raise
    resp = proxy.response(call_id, req, prompt, choices, chat)
    headers["X-Policy-Version"] = str(max(c.version for c in choices))
    if await request.is_disconnected():
      proxy.end(status="incomplete", reason="client_disconnected", choices=choices, **end)
      return JSONResponse(resp, headers=headers)
    proxy.end(status="complete", choices=choices, response=resp, prompt=prompt, **end)
    return JSONResponse(resp, headers=headers)

  # Plain Starlette routes: FastAPI's per-request dependency and response-model machinery,
  # which these routes do not use, is skipped on the serving path.
  async def chat_completions(request: Request):
    return await _complete(request, True)

  async def completions(request: Request):
    return await _complete(request, False)

  app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
  app.add_route("/v1/completions", completions, methods=["POST"])

  async def _dialect(request: Request, dialect):
    tenant, session, fresh = proxy.identity(request.headers)
    body = await _json_body(request, limit)
    return await dialects.serve(proxy, request, dialect, body, tenant, session, fresh)

  async def responses(request: Request):    # the Responses API (responses_api.py)
    return await _dialect(request, responses_api)

  async def messages(request: Request):     # Anthropic's Messages API (messages_api.py)
    return await _dialect(request, messages_api)

  app.add_route("/v1/responses", responses, methods=["POST"])
  app.add_route("/v1/messages", messages, methods=["POST"])

  @app.post("/v1/sessions")
  async def new_session(request: Request):
    tenant, session, _ = proxy.identity(request.headers)
    key = "sk-sess-" + secrets.token_urlsafe(24)
    proxy.store.add_session_key(key, tenant, session)
    return {"id": session, "api_key": key}

  @app.get("/v1/sessions")
  async def list_sessions(request: Request, since: Optional[float] = None):
    return {"object": "list", "data": proxy.store.sessions(proxy.tenant(request.headers),
                                                           since=since)}

  @app.get("/v1/sessions/{session}")
  async def get_session(session: str, request: Request):
    return proxy.session_detail(proxy.tenant(request.headers), session)

  @app.get("/v1/sessions/{session}/samples")
  async def get_samples(session: str, request: Request):
    return proxy.samples(proxy.tenant(request.headers), session)

  @app.post("/v1/sessions/{session}/feedback")
  async def post_feedback(session: str, request: Request):
    tenant = proxy.tenant(request.headers)
    body = await _json_body(request, limit)
    return proxy.feedback(tenant, session, body, None, request.headers.get("idempotency-key"))

  @app.post("/v1/sessions/{session}/calls/{call_id}/feedback")
  async def post_call_feedback(session: str, call_id: str, request: Request):
    tenant = proxy.tenant(request.headers)
    body = await _json_body(request, limit)
    return proxy.feedback(tenant, session, body, call_id, request.headers.get("idempotency-key"))

  return app


async def _stream(proxy: Proxy, req: api.Request, prompt, end: dict, chat: bool, body):
  """The SSE body of a streaming call; records how it ended (module docstring)."""
  call_id, created = end["call_id"], int(time.time())
  ended = False
  try:
    if chat:
      yield api.chunk(call_id, req.model, created, [
          {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
           "finish_reason": None} for i in range(req.n)])
    live = proxy.streams_tokens(req, chat)   # text as it is sampled, else once decoded
    texts = [proxy.text_so_far() for _ in range(req.n)]

    def piece_chunk(index: int, piece: str, kept: list[tuple[int, float]],
                    tops=None) -> Optional[str]:
      """A content delta and the log-probs of the sampled tokens it brings (per token, as the
      whole answer gives them: their concatenation over the stream is the same list); `tops`:
      those tokens' alternatives (id, log-prob) when top_logprobs is asked."""
      lp = None
      if req.logprobs and kept:
        lp = api.token_logprobs([proxy.builder.decode([t]) for t, _ in kept],
                               [x for _, x in kept], proxy.top_texts(tops))
      if not piece and lp is None:
        return None
      if chat:
        return api.chunk(call_id, req.model, created, [
            {"index": index, "delta": {"content": piece}, "finish_reason": None,
             "logprobs": lp}])
      return "data: " + json.dumps({"id": call_id, "object": "text_completion",
                                    "created": created, "model": req.model, "choices": [
                                        {"index": index, "text": piece, "logprobs": None,
                                         "finish_reason": None}]}) + "\n\n"
    sent = [0] * req.n          # per choice, the sampled tokens whose log-probs went out
    try:
      if live:
        async for part in proxy.stream_generate(req, prompt):
          comps = part
          for i, c in enumerate(part):
            piece, kept = texts[i].feed(c.token_ids, c.logprobs, req.stop)
            tops = (None if c.top_logprobs is None
                    else c.top_logprobs[sent[i]:sent[i] + len(kept)])
            sent[i] += len(kept)
            out = piece_chunk(i, piece, kept, tops)
            if out is not None:
              yield out
        choices = [proxy.choice(i, c, req, call_id, chat) for i, c in enumerate(comps)]
      else:
        choices = await proxy.sample(req, prompt, chat, end, body)
    except (api.ApiError, EngineError) as e:
      err = e if isinstance(e, api.ApiError) else api.ApiError(
          503, f"the engine failed: {e}", None, "engine_error", "server_error")
      proxy.end_failed(err, **end)
      ended = True
      yield f"data: {json.dumps(err.body())}\n\n"
      return
    resp = proxy.response(call_id, req, prompt, choices, chat)
    for c in choices:
      content = (c.message.get("content") if c.message is not None else c.text) or ""
      if chat and c.message.get("tool_calls"):   # parsed from the whole text: sent whole
        out = piece_chunk(c.index, content, list(zip(c.token_ids, c.logprobs)), c.top_logprobs)
      else:
        piece, kept = ("", []) if live else texts[c.index].feed(c.token_ids, c.logprobs,
                                                               req.stop)
        rest = texts[c.index].rest(content)
        if rest is None:
          proxy.counts["stream_text_mismatch"] += 1
          rest = ""
        out = piece_chunk(c.index, piece + rest, kept,
                          None if c.top_logprobs is None else c.top_logprobs[:len(kept)])
      if out is not None:
        yield out
      if chat and c.message.get("tool_calls"):
        calls = [dict(tc, index=k) for k, tc in enumerate(c.message["tool_calls"])]
        yield api.chunk(call_id, req.model, created, [
            {"index": c.index, "delta": {"tool_calls": calls}, "finish_reason": None,
             "logprobs": None}])
    if chat:
      yield api.chunk(call_id, req.model, created, [
          {"index": c.index, "delta": {}, "finish_reason": c.finish_reason, "logprobs": None}
          for c in choices], version=max(c.version for c in choices))
    else:
      yield "data: " + json.dumps({"id": call_id, "object": "text_completion",
                                   "created": created, "model": req.model, "choices": [
                                       {"index": c.index, "text": "", "logprobs": None,
                                        "finish_reason": c.finish_reason}
                                       for c in choices]}) + "\n\n"
    if req.include_usage:
      yield api.chunk(call_id, req.model, created, [], usage=resp["usage"])
    # Recorded before the last line: a client that has read [DONE] and then posts a grade for
    # this call (or reads the store) finds it complete, not still open.
    proxy.end(status="complete", choices=choices, response=resp, prompt=prompt, **end)
    ended = True
    yield "data: [DONE]\n\n"
  finally:
    if not ended:  # the client left (or the proxy is stopping) before the stream ended
      proxy.end(status="incomplete", reason="client_disconnected", **end)


def serve(proxy: Proxy, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
          on_ready=None, on_shutdown=None):
  """Runs the proxy with uvicorn until SIGINT / SIGTERM; `on_ready()` once it accepts calls,
  `on_shutdown()` once it has stopped taking them (uvicorn then raises the signal again, so
  the process ends by it: code after `serve` does not run on a signal)."""
  import uvicorn
  app = build_app(proxy)
  if on_ready is not None:
    app.router.on_startup.append(on_ready)
  if on_shutdown is not None:
    app.router.on_shutdown.append(on_shutdown)
  try:
    uvicorn.run(app, host=host, port=port, log_level=log_level)
  finally:
    proxy.close()
