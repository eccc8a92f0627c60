"""Tool calls in a model's own chat format: parse the sampled text, render the calls back.

A sampled assistant turn is text; a family's chat format says where the tool calls are in it.
`parse_turn(text, fmt)` splits it into the content the user would read, the well-formed calls,
and the *malformed* ones. A malformed call is the policy's error (never ours): the environment
answers it with an error message or ends the episode (per config), and it is counted and
charged to the reward, so breaking a call on purpose never pays.

Formats (`TOOL_FORMATS`, one registration each):

* "hermes" (Qwen2 / Qwen2.5 / Qwen3, NousResearch Hermes): every call is a JSON object
  `{"name": str, "arguments": object}` between `<tool_call>` and `</tool_call>`, several per turn
  allowed; the text outside the tags is the content. Malformed: a tag left open, a stray closing
  tag, text between the tags that is not a JSON object, no string "name", "arguments" neither an
  object nor a JSON string holding one.
* "llama3_json" (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the whole turn (after an optional
  `<|python_tag|>`) is one JSON object `{"name": str, "parameters": object}` ("arguments" is
  accepted too); several calls may be separated by ";". A turn that starts with "{" or the python
  tag is a call attempt: if it does not parse, it is malformed (not plain content).

Calls get ids `call_<turn>_<k>` so tool results can refer to them (OpenAI `tool_call_id`).
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable

from posttrain_jax.registry import Registry


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One well-formed call: the tool's name and its arguments object."""
  name: str
  arguments: dict[str, Any]
  id: str = ""

  def to_openai(self) -> dict[str, Any]:
    """The OpenAI chat format's `tool_calls` entry (arguments as a JSON string)."""
    return {"id": self.id, "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


@dataclasses.dataclass(frozen=True)
class MalformedCall:
  """A call attempt that could not be read; `reason` is one of MALFORMED_REASONS."""
  reason: str
  text: str                       # the offending span (for the error message to the model)


MALFORMED_REASONS = ("unclosed_tag", "stray_close_tag", "invalid_json", "not_an_object",
                     "no_name", "bad_arguments")


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
  """A sampled assistant turn split by the chat format."""
  content: str                    # the text outside the calls (stripped)
  tool_calls: tuple[ToolCall, ...] = ()
  malformed: tuple[MalformedCall, ...] = ()

  def message(self) -> dict[str, Any]:
    """The turn as an OpenAI chat message (the record; training uses the sampled tokens)."""
    msg: dict[str, Any] = {"role": "assistant", "content": self.content}
    if self.tool_calls:
      msg["tool_calls"] = [c.to_openai() for c in self.tool_calls]
    return msg


@dataclasses.dataclass(frozen=True)
class ToolFormat:
  name: str
  parse: Callable[[str], tuple[str, list[dict], list[MalformedCall]]]
  render: Callable[[ToolCall], str]   # how the model writes one call (SFT data, prompts)


TOOL_FORMATS: Registry[ToolFormat] = Registry("tool-call format")


def parse_turn(text: str, fmt: str, turn: int = 0) -> ParsedTurn:
  """Splits sampled `text` into content, calls and malformed calls (format `fmt`)."""
  content, raw_calls, malformed = TOOL_FORMATS.get(fmt).parse(text)
  calls, bad = [], list(malformed)
  for obj in raw_calls:
    call = _to_call(obj, f"call_{turn}_{len(calls)}")
    if isinstance(call, MalformedCall):
      bad.append(call)
    else:
      calls.append(call)
  return ParsedTurn(content=content.strip(), tool_calls=tuple(calls), malformed=tuple(bad))


def render_call(call: ToolCall, fmt: str) -> str:
  """`call` as the model of format `fmt` writes it."""
  return TOOL_FORMATS.get(fmt).render(call)


def _to_call(obj: Any, call_id: str) -> ToolCall | MalformedCall:
  text = json.dumps(obj)[:200] if not isinstance(obj, str) else obj[:200]
  if not isinstance(obj, dict):
    return MalformedCall("not_an_object", text)
  name = obj.get("name")
  if not isinstance(name, str) or not name:
    return MalformedCall("no_name", text)
  args = obj.get("arguments", obj.get("parameters", {}))
  if isinstance(args, str):  # OpenAI style: a JSON string holding the object
    try:
      args = json.loads(args) if args.strip() else {}
    except json.JSONDecodeError:
      return MalformedCall("bad_arguments", text)
  if args is None:
    args = {}
  if not isinstance(args, dict):
    return MalformedCall("bad_arguments", text)
  return ToolCall(name=name, arguments=args, id=call_id)


def _loads(span: str) -> Any | MalformedCall:
  try:
    return json.loads(span)
  except json.JSONDecodeError:
    return MalformedCall("invalid_json", span[:200])


# -- hermes ------------------------------------------------------------------------------------

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_TAG = re.compile(r"</?tool_call>")


def _parse_hermes(text: str):
  content, calls, bad = [], [], []
  pos, open_at = 0, None
  for m in _TAG.finditer(text):
    if m.group() == _OPEN:
      if open_at is not None:  # a second <tool_call> before the first closed
        bad.append(MalformedCall("unclosed_tag", text[open_at:m.start()][:200]))
      else:
        content.append(text[pos:m.start()])
      open_at = m.end()
    else:
      if open_at is None:
        bad.append(MalformedCall("stray_close_tag", text[max(0, m.start() - 100):m.end()]))
        content.append(text[pos:m.start()])
      else:
        obj = _loads(text[open_at:m.start()].strip())
        (bad if isinstance(obj, MalformedCall) else calls).append(obj)
        open_at = None
    pos = m.end()
  if open_at is not None:
    bad.append(MalformedCall("unclosed_tag", text[open_at:][:200]))
  else:
    content.append(text[pos:])
  return "".join(content), calls, bad


def _render_hermes(call: ToolCall) -> str:
  return f"{_OPEN}\n{json.dumps({'name': call.name, 'arguments': call.arguments})}\n{_CLOSE}"


TOOL_FORMATS.register("hermes")(ToolFormat("hermes", _parse_hermes, _render_hermes))


# -- llama 3 JSON ------------------------------------------------------------------------------

_PYTHON_TAG = "<|python_tag|>"


def _parse_llama3(text: str):
  body = text.strip()
  tagged = body.startswith(_PYTHON_TAG)
  if tagged:
    body = body[len(_PYTHON_TAG):].strip()
  for end in ("<|eom_id|>", "<|eot_id|>"):
    if body.endswith(end):
      body = body[:-len(end)].strip()
  if not (tagged or body.startswith("{")):
    return text, [], []
  calls, bad = [], []
  decoder = json.JSONDecoder()
  pos = 0
  while pos < len(body):
    try:
      obj, end = decoder.raw_decode(body, pos)
    except json.JSONDecodeError:
      bad.append(MalformedCall("invalid_json", body[pos:pos + 200]))
      break
    calls.append(obj)
    pos = end
    rest = body[pos:].lstrip()
    if not rest:
      break
    if not rest.startswith(";"):
      bad.append(MalformedCall("invalid_json", rest[:200]))
      break
    pos = len(body) - len(rest) + 1
    while pos < len(body) and body[pos].isspace():
      pos += 1
  return "", calls, bad


def _render_llama3(call: ToolCall) -> str:
  return json.dumps({"name": call.name, "parameters": call.arguments})


TOOL_FORMATS.register("llama3_json")(ToolFormat("llama3_json", _parse_llama3, _render_llama3))
