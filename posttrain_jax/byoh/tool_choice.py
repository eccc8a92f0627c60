"""Forced tool calls without constrained decoding (`Proxy.sample` calls `sample`).

No engine here constrains decoding to a tool-call grammar, so `tool_choice` "required" / a named function is met by
(1) a prefill: the assistant turn starts with the chat format's call opening, up to the
function's `"name":` key, or for a named function up to its `"arguments":` key
(`<tool_call>\n{"name": "add", "arguments":` in hermes). Those are prompt tokens (recorded in
the call's prompt, never trained as sampled), the prefill ends before a space, where byte-level
BPE pre-tokenizers split, so the sampled tokens are the ones the model would write there; and
(2) rejection: an answer that still has no (matching) call is drawn again, up to
`ProxyConfig.tool_choice_retries` times, each with a new seed (derived from the request's, so a
seeded request stays reproducible). Every miss is recorded as a call of status "rejected" (never
trained); the call the client gets is the accepted sample, recorded with its own log-probs (the
policy's, not the policy conditioned on calling a tool: rejection is a selection the recorded
log-probs do not correct). If no sample meets it, the client gets a 422 naming `tool_choice`
and the call itself is recorded "rejected". A call to another function than the named one is a
miss. `parallel_tool_calls` false: an answer with several calls is cut after its first, as a
stop string cuts (the tokens up to the end of that call are kept, the rest dropped, so what is
trained is exactly a prefix of what was sampled); one that cannot be cut so is a miss.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from typing import Any, Optional

from posttrain_jax.byoh import openai_api as api
from posttrain_jax.byoh.prompts import Prompt, normalize_messages
from posttrain_jax.byoh.store import Choice
from posttrain_jax.envs.tool_calls import ToolCall, render_call

_PROBE_NAME, _PROBE_KEY = "ptj_probe_name", "ptj_probe_key"


def call_prefill(fmt: str, name: Optional[str]) -> str:
  """The opening of a tool call in format `fmt` (envs/tool_calls.py renders it): up to the
  `"name":` key, or, for the function `name`, up to its arguments' key. It ends before the space
  that follows (module docstring)."""
  if name is None:
    text = render_call(ToolCall(_PROBE_NAME, {}), fmt)
    return text[:text.index(json.dumps(_PROBE_NAME))].rstrip()
  text = render_call(ToolCall(name, {_PROBE_KEY: 0}), fmt)
  return text[:text.index("{" + json.dumps(_PROBE_KEY))].rstrip()


def retry_seed(seed: Optional[int], attempt: int) -> Optional[int]:
  """The seed of a forced tool call's `attempt`-th new draw: derived from the request's (a
  seeded request stays reproducible), distinct from it and from vLLM's seed + j per choice."""
  if seed is None:
    return None
  return int(hashlib.sha256(f"{seed}/retry/{attempt}".encode()).hexdigest()[:15], 16)


async def sample(proxy, req: api.Request, prompt: Prompt, chat: bool, end: dict,
                 body: Any) -> list[Choice]:
  """The call's choices (generate, then `choice`), meeting a forced `tool_choice` and
  `parallel_tool_calls` false by drawing a missed choice again (module docstring): each miss
  is recorded as a "rejected" call; `api.Unsatisfied` (a 422) when the retries run out."""
  call_id = end["call_id"]
  comps = await proxy.generate(req, prompt)
  choices = [proxy.choice(i, c, req, call_id, chat, prompt.prefill) for i, c in enumerate(comps)]
  if not (chat and req.parses_tools and proxy.tool_format):
    return choices
  rounds = 1 + max(proxy.cfg.tool_choice_retries, 0)
  for attempt in range(1, rounds):
    missed = [c for c in choices if miss(req, c)]
    if not missed:
      return choices
    reject(proxy, f"{call_id}-rejected-{attempt}", missed, req, prompt, end, body,
           f"{miss(req, missed[0])} (sample round {attempt} of {rounds}); the call "
           f"{call_id} drew again")
    again = await proxy.generate(dataclasses.replace(
        req, n=len(missed), seed=retry_seed(req.seed, attempt)), prompt)
    for c, comp in zip(missed, again):
      choices[c.index] = proxy.choice(c.index, comp, req, call_id, chat, prompt.prefill)
  why = next((miss(req, c) for c in choices if miss(req, c)), None)
  if why is None:
    return choices
  proxy.counts["tool_choice_unsatisfied"] += 1
  wanted = ("one call of the function " + repr(req.tool_name) if req.tool_name else
            "a tool call" if req.tool_choice == "required" else "at most one tool call")
  param = "tool_choice" if req.tool_choice == "required" else "parallel_tool_calls"
  raise api.Unsatisfied(
      f"{param}: the model did not answer with {wanted} in {rounds} samples (the last: {why}); "
      f"this server cannot constrain decoding, so it draws again up to "
      f"tool_choice_retries={rounds - 1} times. The samples are recorded as rejected, never "
      "trained. Send the request again, or relax tool_choice", param, choices)


def miss(req: api.Request, c: Choice) -> Optional[str]:
  """Why choice `c` misses the request's tool_choice / parallel_tool_calls (None: it meets
  them)."""
  calls = (c.message or {}).get("tool_calls") or []
  if req.tool_choice == "required" and not calls:
    return "no tool call"
  other = [tc["function"]["name"] for tc in calls if tc["function"]["name"] != req.tool_name]
  if req.tool_name is not None and other:
    return f"a call of {other[0]!r}, not {req.tool_name!r}"
  if not req.parallel_tool_calls and len(calls) > 1:
    return f"{len(calls)} tool calls"
  return None


def reject(proxy, rid: str, missed: list[Choice], req: api.Request, prompt: Prompt,
           end: dict, body, reason: str) -> None:
  """Records `missed` (samples of call end["call_id"] the client never gets) as call `rid` of
  status "rejected", of the same session and prompt: kept, and never trained."""
  proxy.record_begin(rid, end["kind"], end["tenant"], end["session"], body, end["messages"],
                     req.tools, prompt)
  for c in missed:
    c.message = normalize_messages([c.message])[0] if c.message is not None else None
  proxy.store.end_call(rid, status="rejected", choices=list(missed), reason=reason,
                       latency_s=time.perf_counter() - end["t0"])
  proxy.counts["rejected"] += 1
