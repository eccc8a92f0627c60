"""A harness's chat → the prompt ids the engine sees, reusing the ids it sampled before.

A harness sends its whole history on every call, as messages. Re-rendering that history through
the chat template and tokenising it again would train on text we never sampled: the template
normalises tool-call JSON, strips thinking, BPE merges across turn boundaries. Instead the
proxy remembers each call's prompt ids and sampled ids, and when a new chat *continues* one:

    messages[:k] == earlier.messages      (the same history, normalised; the same tools)
    messages[k]  == earlier.choice[j]     (the assistant message we returned, echoed back)

the new prompt is spliced, never re-tokenised:

    ids = earlier.prompt_ids + earlier.choice[j].token_ids + encode(glue)

where `glue` is what our template puts after that assistant turn (its end-of-turn, the tool
results and user messages that follow, the next generation prompt). It is found by rendering
the chat with the assistant turn replaced by a sentinel: everything after the sentinel, less the
end-of-turn token the model already sampled. So the engine sees its own tokens, and the trace
rebuilder (rebuild.py) finds the continuation by token prefix.

A chat that continues nothing is rendered whole (`render` once, `encode` once) and starts a new
training sample; the reason is recorded: "system_prompt_changed", "tools_changed", "sub_agent"
(a conversation that shares no message with an earlier one and holds none of our turns),
"history_edited" (an earlier message or our assistant turn came back changed), "repeated_prompt" (the same chat again, e.g. a
retry). The first call of a session has no reason.

Messages are normalised before comparison: `developer` is `system`, `content: None` is "",
a list of text parts is their concatenation, tool-call arguments compare as parsed JSON, and
tool-call ids (which templates do not render) are ignored.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional, Sequence

SENTINEL = "\u27e6posttrain_jax:assistant-turn\u27e7"  # text no template rewrites


class MessageError(ValueError):
  """A request's messages cannot be read; `param` names the field (OpenAI error style)."""

  def __init__(self, message: str, param: str):
    super().__init__(message)
    self.param = param


def _text(content: Any, param: str) -> str:
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    out = []
    for i, part in enumerate(content):
      if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
          part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise MessageError(f"content part of type {kind!r} is not supported (text only)",
                           f"{param}[{i}]")
      out.append(part["text"])
    return "".join(out)
  raise MessageError("content must be a string, a list of text parts or null", param)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
  """The request's `messages` in the form we render and compare (module docstring)."""
  if not isinstance(messages, list) or not messages:
    raise MessageError("messages must be a non-empty list", "messages")
  out = []
  for i, m in enumerate(messages):
    p = f"messages[{i}]"
    if not isinstance(m, dict):
      raise MessageError("a message must be an object", p)
    role = m.get("role")
    if role == "developer":
      role = "system"
    if role not in ("system", "user", "assistant", "tool"):
      raise MessageError(f"role {role!r}; valid: system, developer, user, assistant, tool",
                         f"{p}.role")
    msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{p}.content")}
    if role == "assistant" and m.get("tool_calls"):
      calls = m["tool_calls"]
      if not isinstance(calls, list):
        raise MessageError("tool_calls must be a list", f"{p}.tool_calls")
      msg["tool_calls"] = []
      for k, tc in enumerate(calls):
        q = f"{p}.tool_calls[{k}]"
        f = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
          raise MessageError("a tool call needs function.name", q)
        args = f.get("arguments", "{}")
        if not isinstance(args, str):
          args = json.dumps(args)
        msg["tool_calls"].append({"id": str(tc.get("id", "")), "type": "function",
                                  "function": {"name": f["name"], "arguments": args}})
    if role == "tool":
      msg["tool_call_id"] = str(m.get("tool_call_id", ""))
      if m.get("is_error") is not None and not isinstance(m["is_error"], bool):
        raise MessageError("is_error must be a boolean", f"{p}.is_error")
      if m.get("is_error"):   # the harness says the tool failed (Messages' tool_result.is_error)
        msg["is_error"] = True
    out.append(msg)
  return out


def _args(s: str) -> Any:
  try:
    return json.loads(s)
  except (TypeError, json.JSONDecodeError):
    return s


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
  """Equal as far as any template can tell (ids ignored, arguments compared parsed)."""
  if a["role"] != b["role"] or a["content"] != b["content"]:
    return False
  if a["role"] == "tool":
    return True
  ca, cb = a.get("tool_calls") or [], b.get("tool_calls") or []
  return len(ca) == len(cb) and all(
      x["function"]["name"] == y["function"]["name"]
      and _args(x["function"]["arguments"]) == _args(y["function"]["arguments"])
      for x, y in zip(ca, cb))


def _same_history(a: Sequence[dict], b: Sequence[dict]) -> bool:
  return len(a) == len(b) and all(same_message(x, y) for x, y in zip(a, b))


@dataclasses.dataclass(frozen=True)
class Prompt:
  """What the engine is sent for one call, and where it comes from."""
  text: str                       # the text `ids` stand for
  ids: list[int]
  parent: Optional[tuple[str, int]] = None   # (call id, choice index) this prompt continues
  break_reason: Optional[str] = None         # why it continues nothing (None: first call)
  prefill: str = ""               # the start of the assistant turn the proxy wrote (the end of
                                  # `text`; prompt tokens): the sampled text continues it
  tenant: str = ""                # whose call it is: the engine view that serves it
                                  # (Proxy.engine_for; per-tenant adapters)


@dataclasses.dataclass
class Turn:
  """An earlier call of the session, as the builder needs it (a view of a CallRecord)."""
  call_id: str
  kind: str                       # "chat" | "completion"
  messages: Optional[list[dict[str, Any]]]
  tools: Optional[list[dict[str, Any]]]
  prompt_text: str
  prompt_ids: list[int]
  choices: list[Any]              # store.Choice: token_ids, message, finish_reason


class PromptBuilder:
  """Renders chats with the tokenizer's chat template, splicing earlier sampled ids in."""

  def __init__(self, tokenizer, stop_token_ids: Sequence[int] = ()):
    self.tok = tokenizer
    self.stop_ids = {int(t) for t in stop_token_ids}

  def render(self, messages: list[dict[str, Any]], tools: Optional[list] = None) -> str:
    return self.tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                        add_generation_prompt=True)

  def encode(self, text: str) -> list[int]:
    return list(self.tok(text, add_special_tokens=False)["input_ids"])

  def decode(self, ids: Sequence[int]) -> str:
    return self.tok.decode(list(ids), skip_special_tokens=False,
                           clean_up_tokenization_spaces=False)

  # -- chat ------------------------------------------------------------------------------------

  def chat(self, messages: list[dict[str, Any]], tools: Optional[list],
           history: Sequence[Turn]) -> Prompt:
    """The prompt for normalised `messages` given the session's earlier complete calls."""
    tools = tools or None
    best: Optional[tuple[Turn, int]] = None
    for turn in history:
      if turn.kind != "chat" or turn.messages is None or (turn.tools or None) != tools:
        continue
      k = len(turn.messages)
      if len(messages) <= k or (best and k < len(best[0].messages)):
        continue
      if not _same_history(messages[:k], turn.messages):
        continue
      j = next((c.index for c in turn.choices
                if c.message is not None and same_message(messages[k], c.message)), None)
      if j is not None:
        best = (turn, j)
    if best is not None:
      spliced = self._splice(messages, tools, *best)
      if spliced is not None:
        return spliced
      reason = "turn_end_mismatch"
    else:
      reason = self._break_reason(messages, tools, history)
    text = self.render(messages, tools)
    return Prompt(text, self.encode(text), None, reason)

  def _splice(self, messages, tools, turn: Turn, j: int) -> Optional[Prompt]:
    k = len(turn.messages)
    probe = messages[:k] + [{"role": "assistant", "content": SENTINEL}] + messages[k + 1:]
    text = self.render(probe, tools)
    if text.count(SENTINEL) != 1:
      return None                 # the template dropped or repeated the turn
    after = text[text.index(SENTINEL) + len(SENTINEL):]
    choice = next(c for c in turn.choices if c.index == j)
    ids = list(choice.token_ids)
    if ids and ids[-1] in self.stop_ids:   # the model sampled its end of turn: not glue again
      end = self.decode(ids[-1:])
      if not after.startswith(end):
        return None
      after = after[len(end):]
    glue = self.encode(after)
    return Prompt(turn.prompt_text + self.decode(ids) + after, turn.prompt_ids + ids + glue,
                  (turn.call_id, j), None)

  @staticmethod
  def _break_reason(messages, tools, history: Sequence[Turn]) -> Optional[str]:
    chats = [t for t in history if t.kind == "chat" and t.messages is not None]
    if not chats:
      return None if not history else "sub_agent"

    def common(t: Turn) -> int:
      n = 0
      for a, b in zip(messages, t.messages):
        if not same_message(a, b):
          break
        n += 1
      return n
    near = max(reversed(chats), key=common)   # the most messages in common, newest on ties
    n = common(near)
    if n == 0:
      first_new, first_old = messages[0], near.messages[0]
      if first_new["role"] == first_old["role"] == "system":
        return "system_prompt_changed"
      ours = [c.message for t in chats for c in t.choices if c.message is not None]
      if any(m["role"] == "assistant" and any(same_message(m, o) for o in ours)
             for m in messages):
        return "history_edited"   # the first message changed under a turn we served
      return "sub_agent"
    if (near.tools or None) != tools:
      return "tools_changed"
    if n == len(messages) == len(near.messages):
      return "repeated_prompt"
    return "history_edited"

  # -- completions ------------------------------------------------------------------------------

  def completion(self, prompt: str | list[int], history: Sequence[Turn]) -> Prompt:
    """The prompt of a /v1/completions call: token ids as given, or text, spliced onto an
    earlier completion call whose prompt + sampled text it extends."""
    turns = [t for t in history if t.kind == "completion"]
    if isinstance(prompt, list):
      best = None
      for t in turns:
        for c in t.choices:
          stream = t.prompt_ids + list(c.token_ids)
          if prompt[:len(stream)] == stream and (best is None or len(stream) > best[0]):
            best = (len(stream), t.call_id, c.index)
      text = self.decode(prompt)
      if best:
        return Prompt(text, list(prompt), best[1:], None)
      return Prompt(text, list(prompt), None, "history_edited" if turns else None)
    best = None
    for t in turns:
      for c in t.choices:
        stream = t.prompt_text + self.decode(c.token_ids)
        if prompt.startswith(stream) and (best is None or len(stream) > len(best[0])):
          best = (stream, t, c)
    if best:
      stream, t, c = best
      return Prompt(prompt, t.prompt_ids + list(c.token_ids) + self.encode(prompt[len(stream):]),
                    (t.call_id, c.index), None)
    return Prompt(prompt, self.encode(prompt), None, "history_edited" if turns else None)
