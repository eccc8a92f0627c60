"""The recording proxy: an OpenAI-compatible server in front of any engine, recording every call.

    POST /v1/chat/completions      chat (streaming or not, tools, n, logprobs, seed, stop)
    POST /v1/completions           text or token-id prompts
    POST /v1/responses             the Responses API (responses_api.py)
    POST /v1/messages              Anthropic's Messages API (messages_api.py)
    GET  /v1/models                the served model
    POST /v1/sessions              a new session and its own API key (for harnesses that can
                                   set only a base URL and a key)
    GET  /v1/sessions[/{id}]       the tenant's sessions; one session's calls and feedback
    GET  /v1/sessions/{id}/samples the session rebuilt into training samples (rebuild.py)
    POST /v1/sessions/{id}/feedback, /v1/sessions/{id}/calls/{call}/feedback
                                   a grade, a rubric and/or free text, any time later, idempotent

Who calls: `Authorization: Bearer <key>` (or `x-api-key: <key>`, as Anthropic's clients send
it; the same keys in every dialect). A key of `ProxyConfig.api_keys` names a tenant; a
session key (from POST /v1/sessions) names a tenant and a session. With keys configured, a
missing or unknown key is a 401; without, every caller is tenant "default". The session is the
session key's, else the `X-Session-Id` header, else a new one per call (sent back in the
`X-Session-Id` response header). A tenant never sees another tenant's sessions (they read as
404, like sessions that do not exist).

Each call: validate (openai_api.py: a 4xx naming the field, nothing recorded; a field the
engine cannot honour -- `top_logprobs` past its `max_top_logprobs`, a `response_format` without
`guided_decoding`, engines/base.py -- is a 400 too, and so is a prompt + max_tokens past the
engine's `context_len`, naming max_tokens), build the prompt (prompts.py: earlier sampled ids
spliced in), record the call (store.py), generate on a worker thread (a call asking for more
than `long_request_tokens` waits for one of workers - 1 threads, so one is always left to
shorter calls), parse tool calls with the chat format's parser (envs/tool_calls.py, so
tool_choice="auto" works whatever the engine), answer, record the result. A client that leaves
before the answer is complete leaves its call "incomplete"; an engine failure is a 503 and an
"error" call. Both are kept and never trained on.

Forced tool calls without constrained decoding: tool_choice.py (a prefill, then rejection).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import threading
import time
import uuid
from typing import Any, Optional

from posttrain_jax.byoh import openai_api as api
from posttrain_jax.byoh import tool_choice
from posttrain_jax.byoh.backpressure import MODES as BACKPRESSURE, Gate
from posttrain_jax.byoh.prompts import MessageError, Prompt, PromptBuilder, Turn, normalize_messages
from posttrain_jax.byoh.rebuild import rebuild_session
from posttrain_jax.byoh.store import Choice, Feedback, TraceStore
from posttrain_jax.byoh.stream_text import StreamText
from posttrain_jax.byoh.tool_choice import call_prefill
from posttrain_jax.engines.base import EngineError, PromptTooLongError, capability
from posttrain_jax.engines.coalesce import Coalescer
from posttrain_jax.envs.tool_calls import ToolCall, parse_turn

DEFAULT_TENANT = "default"


def detect_tool_format(tokenizer) -> Optional[str]:
  """The tool-call parser a chat template writes calls for: "hermes" (`<tool_call>`),
  "llama3_json" (the `ipython` role / `<|python_tag|>`), or None (no tools)."""
  template = getattr(tokenizer, "chat_template", None) or ""
  if "<tool_call>" in template:
    return "hermes"
  if "<|python_tag|>" in template or "ipython" in template:
    return "llama3_json"
  return None


@dataclasses.dataclass
class ServedChoice(Choice):
  """A choice as served: what the store keeps of it, and what only the response carries."""
  top_logprobs: Optional[list] = None   # per token, the most likely (id, log-prob) pairs when
                                        # asked (the recorded response holds them as text)


@dataclasses.dataclass(frozen=True)
class ProxyConfig:
  """How the proxy serves and whom it lets in."""
  model_name: str = "posttrain_jax"     # the model id served (requests must name it)
  api_keys: tuple[tuple[str, str], ...] = ()   # (key, tenant) pairs; empty = no auth
  max_request_bytes: int = 4 << 20      # larger bodies are a 413
  max_tokens_default: int = 256         # max_tokens when the request sets none
  max_tokens_limit: int = 4096          # the most a request may ask for
  max_n: int = 16                       # the most choices per request
  max_prompt_tokens: int = 0            # longer prompts are a 400 (0 = the engine's own limit)
  workers: int = 4                      # threads running engine calls
  long_request_tokens: int = 1024       # calls asking for more max_tokens run on at most
                                        # workers - 1 threads: one stays free for shorter calls
                                        # (0 = no lane; engines/turns.py shares the device)
  session_cache: int = 4096             # sessions whose history stays in memory
  tool_choice_retries: int = 2          # a forced tool_choice missed: draw again up to this many
                                        # times (new seeds), then answer 422 (module docstring)
  tool_choice_prefill: bool = True      # a forced tool_choice: start the assistant turn with the
                                        # format's call opening (prompt tokens; module docstring)
  backpressure: str = "reject"          # the learner behind (backpressure.py): "reject" = 429
                                        # + Retry-After at once; "queue" = wait, then 429
  max_pending_sessions: int = 0         # sessions served and not yet trained past which new ones
                                        # wait or are refused; 0 = no bound; -1 (online) =
                                        # (rl.traces.max_staleness + 1) * prompts_per_step
  queue_timeout_s: float = 30.0         # "queue": the longest a call waits before its 429
  retry_after_s: float = 1.0            # Retry-After before the learner has timed a step
  coalesce_ms: float = 0.0              # > 0: concurrent unseeded calls with the same sampling
                                        # go to the engine as one batch (engines/coalesce.py),
                                        # the first waiting this long for others; 0 = one call
                                        # per request

  def __post_init__(self):
    if self.backpressure not in BACKPRESSURE:
      raise ValueError(f"ProxyConfig.backpressure is {self.backpressure!r}; valid: "
                       f"{BACKPRESSURE}")
    if self.coalesce_ms < 0:
      raise ValueError(f"ProxyConfig.coalesce_ms must be >= 0, got {self.coalesce_ms}")
    if self.max_pending_sessions < -1:
      raise ValueError(f"ProxyConfig.max_pending_sessions must be >= -1, got "
                       f"{self.max_pending_sessions}")


class Proxy:
  """The serving state: engine, tokenizer, store, and each session's recent calls."""

  def __init__(self, cfg: ProxyConfig, engine, tokenizer, store: TraceStore,
               stop_token_ids: tuple[int, ...], tool_format: Optional[str],
               engines: Optional[dict] = None):
    self.engines = dict(engines or {})   # tenant -> the engine serving its own adapter
    if cfg.coalesce_ms > 0:
      engine = Coalescer(engine, cfg.coalesce_ms / 1000)
      self.engines = {t: Coalescer(e, cfg.coalesce_ms / 1000) for t, e in self.engines.items()}
    self.cfg, self.engine, self.store, self.tool_format = cfg, engine, store, tool_format
    self.stop_ids = tuple(int(t) for t in stop_token_ids)
    self.builder = PromptBuilder(tokenizer, self.stop_ids)
    self.vocab_size = len(tokenizer)   # prompt token ids must be below it
    self.keys = dict(cfg.api_keys)
    limit = cfg.max_prompt_tokens or getattr(getattr(engine, "cfg", None), "max_prompt_len", 0)
    self.max_prompt_tokens = int(limit or 0)
    self._pool = concurrent.futures.ThreadPoolExecutor(cfg.workers, "proxy-engine")
    self._long_lane = asyncio.Semaphore(max(cfg.workers - 1, 1))
    self._history: collections.OrderedDict = collections.OrderedDict()
    self.counts: collections.Counter = collections.Counter()
    self.gate = Gate(cfg.backpressure, max(cfg.max_pending_sessions, 0), cfg.queue_timeout_s,
                     cfg.retry_after_s)   # set by the learner online (backpressure.py)

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)

  def engine_for(self, tenant: str):
    """The engine a tenant's calls sample from: its own (per-tenant adapters, `engines`), else
    the proxy's. With `engines`, a tenant that has none is refused, never served another's."""
    if not self.engines:
      return self.engine
    if tenant not in self.engines:
      raise api.ApiError(403, f"tenant {tenant!r} has no adapter on this server", None,
                         "no_adapter", "permission_error")
    return self.engines[tenant]

  # -- who is calling -------------------------------------------------------------------------

  def identity(self, headers) -> tuple[str, str, bool]:
    """(tenant, session, session_is_new) of a request, or an ApiError 401."""
    auth = headers.get("authorization", "")
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    key = key or headers.get("x-api-key", "").strip()   # what Anthropic's clients send
    bound = self.store.session_key(key) if key else None
    if bound:
      return bound[0], bound[1], False
    if self.keys:
      if not key:
        raise api.ApiError(401, "missing API key (Authorization: Bearer <key>, or x-api-key)",
                           None, "invalid_api_key", "authentication_error")
      if key not in self.keys:
        raise api.ApiError(401, "invalid API key", None, "invalid_api_key",
                           "authentication_error")
      tenant = self.keys[key]
    else:
      tenant = DEFAULT_TENANT
    session = headers.get("x-session-id")
    if session is not None:
      if not 0 < len(session) <= 200 or not session.isprintable():
        raise api.ApiError(400, "X-Session-Id must be 1..200 printable characters",
                           "X-Session-Id")
      return tenant, session, False
    return tenant, f"sess-{uuid.uuid4().hex}", True

  def tenant(self, headers) -> str:
    return self.identity(headers)[0]

  # -- history ----------------------------------------------------------------------------------

  def history(self, tenant: str, session: str) -> list[Turn]:
    key = (tenant, session)
    if key in self._history:
      self._history.move_to_end(key)
      return self._history[key]
    turns = [Turn(c.id, c.kind, c.messages, c.tools, c.prompt_text, c.prompt_ids, c.choices)
             for c in self.store.calls(tenant, session, status="complete")]
    self._history[key] = turns
    while len(self._history) > self.cfg.session_cache:
      self._history.popitem(last=False)
    return turns

  # -- serving ----------------------------------------------------------------------------------

  def parse(self, body: Any, chat: bool) -> api.Request:
    return api.parse_request(body, chat=chat, models=(self.cfg.model_name,),
                             max_tokens_default=self.cfg.max_tokens_default,
                             max_tokens_limit=self.cfg.max_tokens_limit, max_n=self.cfg.max_n,
                             stop_token_ids=self.stop_ids, vocab_size=self.vocab_size)

  def prepare(self, req: api.Request, tenant: str, session: str,
              max_tokens_field: str = "max_tokens"):
    """The call's id, normalised messages and prompt; ApiError for what cannot be served
    (`max_tokens_field`: the name the client's API gives max_tokens, for a 400 naming it)."""
    history = self.history(tenant, session)
    if req.messages is not None:
      try:
        messages = normalize_messages(req.messages)
      except MessageError as e:
        raise api.ApiError(400, str(e), e.param) from None
      try:
        prompt = self.builder.chat(messages, req.tools, history)
      except Exception as e:  # the template cannot render this chat (jinja error)
        raise api.ApiError(400, f"the chat template cannot render these messages: {e}",
                           "messages") from None
      prefix = "chatcmpl"
    else:
      messages, prefix = None, "cmpl"
      prompt = self.builder.completion(req.prompt, history)
    self._check_capabilities(req)
    if req.tool_choice == "required" and messages is not None and self.cfg.tool_choice_prefill:
      text = call_prefill(self.tool_format, req.tool_name)
      prompt = dataclasses.replace(prompt, text=prompt.text + text,
                                   ids=prompt.ids + self.builder.encode(text), prefill=text)
    if self.max_prompt_tokens and len(prompt.ids) > self.max_prompt_tokens:
      raise api.ApiError(400, f"the prompt has {len(prompt.ids)} tokens; this server accepts "
                         f"at most {self.max_prompt_tokens}", "messages" if messages else "prompt",
                         "context_length_exceeded")
    self._check_context(len(prompt.ids), req.sampling.max_tokens, max_tokens_field,
                        "messages" if messages else "prompt")
    self.engine_for(tenant)   # a tenant without an adapter: a 403 before anything is recorded
    return f"{prefix}-{uuid.uuid4().hex}", messages, dataclasses.replace(prompt, tenant=tenant)

  def _check_context(self, prompt_tokens: int, max_tokens: int, max_tokens_field: str,
                     prompt_field: str) -> None:
    """A 400 when prompt + max_tokens exceeds the engine's model context (its `context_len`,
    engines/base.py; unknown: the engine's own error names the field later), naming max_tokens
    where a smaller one fits, else the prompt."""
    room = int(capability(self.engine, "context_len") or 0)
    if not room or prompt_tokens + max_tokens <= room:
      return
    fits = prompt_tokens < room
    raise api.ApiError(400, f"the prompt has {prompt_tokens} tokens and {max_tokens_field}="
                       f"{max_tokens}; together they exceed the model's context of {room} tokens"
                       + (f": ask for at most {room - prompt_tokens}" if fits else ""),
                       max_tokens_field if fits else prompt_field, "context_length_exceeded")

  def _check_capabilities(self, req: api.Request) -> None:
    """A 400 naming the field the engine (or the chat template) cannot honour."""
    k, most = req.sampling.top_logprobs, capability(self.engine, "max_top_logprobs")
    if k > most:
      raise api.ApiError(400, f"top_logprobs={k}: this server's engine returns "
                         f"{f'at most {most}' if most else 'no'} alternative tokens per position",
                         "top_logprobs", "unsupported_parameter")
    if req.sampling.response_format is not None and not capability(self.engine,
                                                                   "guided_decoding"):
      kind = json.loads(req.sampling.response_format)["type"]
      raise api.ApiError(400, f"response_format type {kind!r} needs constrained decoding, which "
                         "this server's engine cannot do (serve with an engine that has guided "
                         "decoding, e.g. configs/serve.py:vllm)", "response_format",
                         "unsupported_parameter")
    if req.tool_choice == "required" and not self.tool_format:
      raise api.ApiError(400, "tool_choice forces a tool call, but the served chat template "
                         "writes no tool calls", "tool_choice", "unsupported_parameter")

  def begin(self, call_id, kind, tenant, session, body, messages, req, prompt: Prompt) -> None:
    self.record_begin(call_id, kind, tenant, session, body, messages, req.tools, prompt)
    self.counts["calls"] += 1
    if prompt.break_reason:
      self.counts[f"break/{prompt.break_reason}"] += 1

  def record_begin(self, call_id, kind, tenant, session, body, messages, tools,
                    prompt: Prompt) -> None:
    self.store.begin_call(call_id=call_id, tenant=tenant, session=session, kind=kind,
                          request=body, prompt_text=prompt.text, prompt_ids=prompt.ids,
                          messages=messages, tools=tools,
                          parent_call=prompt.parent[0] if prompt.parent else None,
                          parent_choice=prompt.parent[1] if prompt.parent else None,
                          break_reason=prompt.break_reason)

  async def sample(self, req: api.Request, prompt: Prompt, chat: bool, end: dict,
                   body: Any) -> list[Choice]:
    """The call's choices, a forced `tool_choice` / `parallel_tool_calls` false met by drawing
    a missed choice again (tool_choice.py)."""
    return await tool_choice.sample(self, req, prompt, chat, end, body)

  def end_failed(self, e: Exception, **end) -> None:
    """Records how a call that raised `e` ended: the samples of an `api.Unsatisfied` as a
    "rejected" call, anything else an "error"."""
    if isinstance(e, api.Unsatisfied):
      self.end(status="rejected", reason=e.message, choices=e.choices, **end)
    else:
      self.end(status="error", reason=getattr(e, "message", None) or str(e), **end)

  async def _submit(self, req: api.Request, work) -> concurrent.futures.Future:
    """`work` on an engine thread; a call asking for more than `long_request_tokens` first
    waits for a place in the long lane (workers - 1 threads), so long calls never hold every
    thread. The place is freed when the work ends, not when its caller stops waiting."""
    long = 0 < self.cfg.long_request_tokens < req.sampling.max_tokens
    if not long:
      return self._pool.submit(work)
    self.counts["long_calls"] += 1
    lane, loop = self._long_lane, asyncio.get_running_loop()
    await lane.acquire()
    try:
      job = self._pool.submit(work)
    except BaseException:
      lane.release()
      raise

    def free(_) -> None:
      try:
        loop.call_soon_threadsafe(lane.release)
      except RuntimeError:  # the loop is gone (the server stopped)
        pass
    job.add_done_callback(free)
    return job

  async def generate(self, req: api.Request, prompt: Prompt):
    for attempt in range(3):  # "abort": cut by a weight swap mid-decode; served again
      try:
        job = await self._submit(
            req, lambda: self.engine_for(prompt.tenant).generate([prompt.ids], req.sampling,
                                                                  req.n, req.seed))
        out = await asyncio.wrap_future(job)
      except api.ApiError:
        raise
      except Exception as e:  # noqa: BLE001 -- what it is for the client: _engine_failure
        raise _engine_failure(e) from e
      comps = out[0]
      if any(c.finish_reason == "error" for c in comps):
        raise EngineError("the engine reported an error for this request")
      if not any(c.finish_reason == "abort" for c in comps):
        return comps
      self.counts["aborted_retries"] += 1
    raise EngineError("the engine aborted the request 3 times")

  def streams_tokens(self, req: api.Request, chat: bool) -> bool:
    """Whether a streamed call can send text as it is sampled: the engine streams (`stream`,
    the embedded sampler) and no tool call has to be parsed out of the whole text first."""
    parse_tools = chat and req.parses_tools and self.tool_format
    return callable(getattr(self.engine, "stream", None)) and not parse_tools

  async def stream_generate(self, req: api.Request, prompt: Prompt):
    """The call's completions as they grow (the engine's `stream`, on a worker thread); the
    last item is final. Each part holds everything so far, so only the newest is kept: a
    client that stops reading costs one part of memory, not one per chunk. Leaving the loop
    early stops the engine's decode."""
    loop = asyncio.get_running_loop()
    wake, lock, cancel = asyncio.Event(), threading.Lock(), threading.Event()
    box: dict[str, Any] = {"part": None, "end": False, "error": None}

    def post(**kw) -> None:
      with lock:
        box.update(kw)
      try:
        loop.call_soon_threadsafe(wake.set)
      except RuntimeError:  # the loop is gone (the server stopped)
        cancel.set()

    def work() -> None:
      if cancel.is_set():   # the client left while this call waited for a worker
        return post(end=True)
      try:
        for part in self.engine_for(prompt.tenant).stream(prompt.ids, req.sampling, req.n,
                                                          req.seed, cancelled=cancel):
          post(part=part)
        post(end=True)
      except BaseException as e:  # noqa: BLE001 -- handed to the event loop below
        post(error=e)

    job = await self._submit(req, work)
    job.add_done_callback(lambda f: f.cancelled() and post(
        error=EngineError("the server stopped before this call was served")))
    last = None
    try:
      while True:
        await wake.wait()
        wake.clear()
        with lock:
          part, end, error = box["part"], box["end"], box["error"]
        if part is not None and part is not last:
          last = part
          yield part
        if error is not None:
          raise _engine_failure(error) from error
        if end:
          break
      if last is None or any(c.finish_reason in ("error", "abort", "") for c in last):
        raise EngineError("the engine's stream ended without a whole answer")
    finally:
      cancel.set()

  def choice(self, i: int, comp, req: api.Request, call_id: str, chat: bool,
             prefill: str = "") -> Choice:
    """One engine completion as the client's choice (stop strings cut, tool calls parsed from
    the `prefill` + the sampled text; `parallel_tool_calls` false: cut after the first call)."""
    ids, lps, finish = list(comp.token_ids), list(comp.logprobs), comp.finish_reason
    tops = list(comp.top_logprobs) if getattr(comp, "top_logprobs", None) is not None else None
    dec = self.builder.decode
    body = ids[:-1] if ids and ids[-1] in self.stop_ids and finish == "stop" else ids
    cut = api.truncate_at_stop(body, dec, req.stop)
    if cut:
      keep, pos = cut
      ids, lps, finish = ids[:keep], lps[:keep], "stop"
      text = dec(ids)[:pos]
    else:
      keep, text = len(ids), dec(body)
    message = None
    if chat:
      message = {"role": "assistant", "content": text}
      if req.parses_tools and self.tool_format:
        turn = parse_turn(prefill + text, self.tool_format)
        if len(turn.tool_calls) > 1 and not turn.malformed and not req.parallel_tool_calls:
          first = self._first_call_end(ids, prefill, turn.tool_calls[0])
          if first is not None:
            keep, ids, lps, text = first, ids[:first], lps[:first], dec(ids[:first])
            turn = parse_turn(prefill + text, self.tool_format)
        if turn.tool_calls and not turn.malformed:
          calls = [dict(c.to_openai(), id=f"call_{call_id[-12:]}_{i}_{k}")
                   for k, c in enumerate(turn.tool_calls)]
          message = {"role": "assistant", "content": turn.content or None, "tool_calls": calls}
          finish = "tool_calls"
        elif turn.malformed:
          self.counts["malformed_tool_calls"] += len(turn.malformed)
    return ServedChoice(index=i, token_ids=ids, logprobs=[float(x) for x in lps],
                        finish_reason=finish, version=int(comp.version), text=text,
                        message=message, top_logprobs=None if tops is None else tops[:keep])

  def _first_call_end(self, ids: list[int], prefill: str, first: ToolCall) -> Optional[int]:
    """The fewest of the sampled `ids` whose text (after `prefill`) holds the call `first`
    whole and no other: where `parallel_tool_calls` false cuts an answer (None: it cannot)."""
    dec, fmt = self.builder.decode, self.tool_format

    def holds(m: int) -> bool:
      calls = parse_turn(prefill + dec(ids[:m]), fmt).tool_calls
      return bool(calls) and (calls[0].name, calls[0].arguments) == (first.name, first.arguments)
    lo, hi = 1, len(ids)
    while lo < hi:
      mid = (lo + hi) // 2
      if holds(mid):
        hi = mid
      else:
        lo = mid + 1
    turn = parse_turn(prefill + dec(ids[:lo]), fmt)
    return lo if holds(lo) and len(turn.tool_calls) == 1 and not turn.malformed else None

  def response(self, call_id: str, req: api.Request, prompt: Prompt, choices: list[Choice],
               chat: bool) -> dict:
    usage = {"prompt_tokens": len(prompt.ids),
             "completion_tokens": sum(len(c.token_ids) for c in choices),
             "total_tokens": len(prompt.ids) + sum(len(c.token_ids) for c in choices)}
    out = []
    for c in choices:
      lp = None
      if req.logprobs:
        toks = [self.builder.decode([t]) for t in c.token_ids]
        tops = self.top_texts(getattr(c, "top_logprobs", None))
        lp = (api.token_logprobs(toks, c.logprobs, tops) if chat else
              {"tokens": toks, "token_logprobs": c.logprobs, "top_logprobs": None,
               "text_offset": []})
      if chat:
        out.append({"index": c.index, "message": {**c.message, "refusal": None},
                    "logprobs": lp, "finish_reason": c.finish_reason})
      else:
        out.append({"index": c.index, "text": c.text, "logprobs": lp,
                    "finish_reason": c.finish_reason})
    version = max(c.version for c in choices)
    if chat:
      return api.chat_response(call_id, req.model, out, usage, version)
    return {"id": call_id, "object": "text_completion", "created": int(time.time()),
            "model": req.model, "choices": out, "usage": usage,
            "system_fingerprint": api.fingerprint(version)}

  def top_texts(self, tops) -> Optional[list[list[tuple[str, float]]]]:
    """Per token, its alternatives (id, log-prob) as (text, log-prob); None stays None."""
    if tops is None:
      return None
    dec = self.builder.decode
    return [[(dec([t]), float(x)) for t, x in row] for row in tops]

  def end(self, call_id, tenant, session, status, t0, choices=(), response=None, reason=None,
          kind="chat", messages=None, tools=None, prompt: Optional[Prompt] = None) -> None:
    for c in choices:  # the stored message is the normalised one (compared on the next call)
      if c.message is not None:
        c.message = normalize_messages([c.message])[0]
    self.store.end_call(call_id, status=status, choices=list(choices), response=response,
                        reason=reason, latency_s=time.perf_counter() - t0)
    self.counts[status] += 1
    if status == "complete" and prompt is not None:
      self.history(tenant, session).append(
          Turn(call_id, kind, messages, tools, prompt.text, prompt.ids, list(choices)))

  def text_so_far(self) -> StreamText:
    return StreamText(self.builder.decode, self.stop_ids)

  # -- feedback ---------------------------------------------------------------------------------

  def feedback(self, tenant: str, session: str, body: Any, call_id: Optional[str],
               idempotency_key: Optional[str]) -> dict:
    if not self.store.has_session(tenant, session):
      raise api.ApiError(404, f"no session {session!r}", "session", "not_found")
    if not isinstance(body, dict):
      raise api.ApiError(400, "the feedback body must be a JSON object")
    unknown = sorted(set(body) - {"grade", "rubric", "text", "call_id", "id"})
    if unknown:
      raise api.ApiError(400, f"unknown feedback field {unknown[0]!r}", unknown[0])
    call_id = call_id or body.get("call_id")
    if call_id is not None:
      c = self.store.call(call_id, tenant)
      if c is None or c.session != session:
        raise api.ApiError(404, f"no call {call_id!r} in session {session!r}", "call_id",
                           "not_found")
    grade, rubric, text = body.get("grade"), body.get("rubric"), body.get("text")
    if grade is not None and (isinstance(grade, bool) or not isinstance(grade, (int, float))
                              or grade != grade):
      raise api.ApiError(400, "grade must be a number", "grade")
    if rubric is not None and not (isinstance(rubric, dict) and all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
        for k, v in rubric.items())):
      raise api.ApiError(400, "rubric must be an object of criterion -> number", "rubric")
    if text is not None and not isinstance(text, str):
      raise api.ApiError(400, "text must be a string", "text")
    if grade is None and not rubric and not text:
      raise api.ApiError(400, "feedback needs a grade, a rubric or a text", "grade")
    fid = body.get("id") or idempotency_key
    if fid is not None and (not isinstance(fid, str) or not 0 < len(fid) <= 200):
      raise api.ApiError(400, "id must be a string of 1..200 characters", "id")
    if fid is None:  # the same feedback posted twice is stored once
      canon = json.dumps([tenant, session, call_id, grade, rubric, text], sort_keys=True)
      fid = "fb-" + hashlib.sha256(canon.encode()).hexdigest()[:32]
    new = self.store.add_feedback(Feedback(
        id=fid, tenant=tenant, session=session, call_id=call_id, created=time.time(),
        grade=None if grade is None else float(grade), rubric=rubric, text=text, source="api"))
    return {"id": fid, "session": session, "call_id": call_id, "created": new}

  def session_detail(self, tenant: str, session: str) -> dict:
    if not self.store.has_session(tenant, session):
      raise api.ApiError(404, f"no session {session!r}", "session", "not_found")
    calls = self.store.calls(tenant, session)
    return {"id": session, "calls": [
        {"id": c.id, "created": c.created, "kind": c.kind, "status": c.status, "reason": c.reason,
         "latency_s": c.latency_s, "prompt_tokens": len(c.prompt_ids),
         "parent_call": c.parent_call, "break_reason": c.break_reason,
         "versions": [ch.version for ch in c.choices]} for c in calls],
        "feedback": [dataclasses.asdict(f) for f in self.store.feedback(tenant, session)]}

  def samples(self, tenant: str, session: str) -> dict:
    if not self.store.has_session(tenant, session):
      raise api.ApiError(404, f"no session {session!r}", "session", "not_found")
    trajs, stats = rebuild_session(session, self.store.calls(tenant, session),
                                   self.store.feedback(tenant, session))
    return {"samples": [t.to_dict() for t in trajs], "stats": dict(stats)}


def _engine_failure(e: BaseException) -> Exception:
  """A failed engine call as the client sees it: a prompt the engine can never serve is a 400
  naming the messages (or max_tokens, when the model's context cannot hold both); anything
  else is our failure (EngineError: a 503)."""
  if isinstance(e, PromptTooLongError):
    return api.ApiError(400, str(e), getattr(e, "param", "messages"), "context_length_exceeded")
  return EngineError(f"{type(e).__name__}: {e}")
