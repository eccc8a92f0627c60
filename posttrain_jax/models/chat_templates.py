"""Chat formats for the tiny models: a Jinja chat template, its special tokens, and where the
tool calls are (the parser name in `posttrain_jax.envs.tool_calls`).

Real checkpoints bring their own template; these reproduce the *formats* of the families we
support, so multi-turn stitching and tool-call parsing are tested on each of them without a
download:

* "chatml"  — `<|im_start|>role\\n…<|im_end|>\\n`, no tools (the default run).
* "hermes"  — ChatML with tools (the Qwen2 / Qwen2.5 / Qwen3 format): tool signatures in the
  system turn inside `<tools></tools>`, calls as `<tool_call>{json}</tool_call>` in the assistant
  turn, results as `<tool_response>` blocks in a user turn (consecutive results share one turn).
* "hermes_thinking" — hermes, and like Qwen3 it drops the `<think>…</think>` part of assistant
  turns that come before the last user message: a template that *edits history* (the stitcher
  must notice and start a new training sample).
* "llama3"  — `<|start_header_id|>role<|end_header_id|>\\n\\n…<|eot_id|>` headers, tool
  signatures in the system turn, calls as one JSON object `{"name", "parameters"}`, results in
  an `ipython` turn (the Llama 3.1 JSON tool-calling format).

An assistant message is rendered from `content` verbatim; structured `tool_calls` (OpenAI
format, arguments as a JSON string or object) are rendered after it the way the model writes
them.
"""
from __future__ import annotations

import dataclasses
import pathlib

from posttrain_jax.errors import UserError
from posttrain_jax.registry import Registry

_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_LLAMA3 = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")


@dataclasses.dataclass(frozen=True)
class ChatFormat:
  """A chat template with the special tokens it needs."""
  name: str
  template: str                   # Jinja, as `tokenizer.chat_template`
  special_tokens: tuple[str, ...]  # added to the tokenizer as special tokens
  eos: tuple[str, ...]            # stop tokens (the first is the tokenizer's eos_token)
  pad: str                        # padding token
  tool_format: str | None         # tool-call parser (envs/tool_calls.py); None = no tools


CHAT_FORMATS: Registry[ChatFormat] = Registry("chat format")

_CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# The calls of an OpenAI assistant message, as the model writes them (hermes).
_HERMES_CALLS = (
    "{%- for tc in message.tool_calls %}"
    "{%- set f = tc.function if tc.function is defined else tc %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}"
    "{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}")


def _hermes(strip_thinking: bool) -> str:
  content = "message.content"
  if strip_thinking:
    content = ("(message.content.split('</think>')[-1].lstrip('\\n') "
               "if loop.index0 < ns.last_user else message.content)")
  return (
      "{%- set ns = namespace(last_user=-1) %}"
      "{%- for message in messages %}{%- if message.role == 'user' %}"
      "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
      "{%- if tools %}"
      "{{- '<|im_start|>system\\n' }}"
      "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
      "{{- '# Tools\\n\\nYou may call one or more functions. Function signatures are within "
      "<tools></tools> XML tags:\\n<tools>' }}"
      "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
      "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
      "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
      "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
      "{%- endif %}"
      "{%- for message in messages %}"
      "{%- if message.role == 'system' %}"
      "{%- if not (tools and loop.first) %}"
      "{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
      "{%- elif message.role == 'user' %}"
      "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
      "{%- elif message.role == 'assistant' %}"
      "{{- '<|im_start|>assistant\\n' + " + content + " }}"
      "{%- if message.tool_calls %}" + _HERMES_CALLS + "{%- endif %}"
      "{{- '<|im_end|>\\n' }}"
      "{%- elif message.role == 'tool' %}"
      "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
      "{{- '<|im_start|>user' }}{%- endif %}"
      "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
      "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
      "{{- '<|im_end|>\\n' }}{%- endif %}"
      "{%- endif %}"
      "{%- endfor %}"
      "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


_LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if tools or messages[0].role == 'system' %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- endif %}"
    "{%- if tools %}"
    "{{- '\\n\\nYou have access to the following functions. To call a function, respond with "
    "JSON: {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}.\\n' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content }}"
    "{%- if message.tool_calls %}"
    "{%- for tc in message.tool_calls %}"
    "{%- set f = tc.function if tc.function is defined else tc %}"
    "{%- if not loop.first %}{{- '; ' }}{%- endif %}"
    "{{- '{\"name\": \"' + f.name + '\", \"parameters\": ' }}"
    "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}"
    "{%- endif %}{{- '}' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

for _fmt in (
    ChatFormat("chatml", _CHATML_TEMPLATE, _CHATML, ("<|im_end|>", "<|endoftext|>"),
               "<|endoftext|>", None),
    ChatFormat("hermes", _hermes(False), _CHATML, ("<|im_end|>", "<|endoftext|>"),
               "<|endoftext|>", "hermes"),
    ChatFormat("hermes_thinking", _hermes(True), _CHATML, ("<|im_end|>", "<|endoftext|>"),
               "<|endoftext|>", "hermes"),
    ChatFormat("llama3", _LLAMA3_TEMPLATE, _LLAMA3, ("<|eot_id|>", "<|end_of_text|>"),
               "<|end_of_text|>", "llama3_json"),
):
  CHAT_FORMATS.register(_fmt.name)(_fmt)


def template_override(spec: str, field: str = "model.chat_template") -> str:
  """The Jinja text `spec` names: a registered chat format ("hermes", "llama3", ...) or a file
  holding a template. Serving a checkpoint whose own template drops `tools` (SmolLM2's does)
  under a tool-calling format is vLLM's `--chat-template` and `--tool-call-parser`: the proxy
  detects the parser from the template it renders with. Anything else: one UserError naming
  `field`."""
  if spec in CHAT_FORMATS:
    return CHAT_FORMATS.get(spec).template
  path = pathlib.Path(spec).expanduser()
  if path.is_file():
    return path.read_text()
  raise UserError(f"{field}={spec!r} is neither a chat format ({', '.join(CHAT_FORMATS.names())}) "
                   "nor a template file")
