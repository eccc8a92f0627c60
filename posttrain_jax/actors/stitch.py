"""Token-exact stitching of a multi-turn episode into training samples.

One episode is a single token stream as long as every turn's prompt *extends* what came before:

    stream = prompt_0 + sampled_0 + glue_1 + sampled_1 + glue_2 + ...

`sampled_k` are the ids the engine returned for turn k (loss mask 1, their log-probs, the policy
version that sampled them); `glue_k` is what the chat template puts between two assistant turns
(end of turn, the environment's tool results or follow-ups, the next generation prompt): mask 0.
Training never re-tokenises sampled text.

Each turn the whole chat is rendered through the template again (`text_k`), and the stitcher
*checks* that it extends the stream before it appends, in one of two modes:

* "tokens" (default): the stream's text (the rendered prompt plus the decoded sampled ids) must
  be a prefix of `text_k`; the glue is the tokenisation of the rest, and the next prompt is
  `stream + glue` — what the engine sees is exactly what the learner trains on.
* "template": the next prompt is the template's own tokenisation of the whole chat (what an
  OpenAI chat server would send); its first `len(stream)` ids must equal the stream.

When the check fails a new training sample starts from the full rendering (mask 0), and the
break is counted by reason:
  "thinking_stripped"  the template dropped `<think>…</think>` from earlier assistant turns,
  "rerendered_turn"    the last sampled turn came back different (tool-call JSON normalised,
                       `false` re-rendered as `False`, whitespace),
  "history_edited"     something before the last turn changed,
  "retokenized"        ("template" mode) same text, other ids: BPE merges across a boundary.
Every sample of an episode carries the episode's reward; each sampled token its own version.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Optional, Sequence

STITCH_MODES = ("tokens", "template")


@dataclasses.dataclass
class Sample:
  """One training sample: a token stream with its per-token loss mask, log-probs and versions."""
  token_ids: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)

  def add(self, ids: Sequence[int], logprobs: Optional[Sequence[float]] = None,
          version: int = -1) -> None:
    """Appends `ids`: sampled (with log-probs and version, mask 1) or glue (mask 0)."""
    ids = [int(t) for t in ids]
    self.token_ids += ids
    if logprobs is None:
      self.loss_mask += [0] * len(ids)
      self.logprobs += [0.0] * len(ids)
      self.versions += [-1] * len(ids)
    else:
      if len(logprobs) != len(ids):
        raise ValueError(f"{len(ids)} sampled ids but {len(logprobs)} log-probs")
      self.loss_mask += [1] * len(ids)
      self.logprobs += [float(x) for x in logprobs]
      self.versions += [int(version)] * len(ids)

  @property
  def num_sampled(self) -> int:
    return sum(self.loss_mask)

  def through_last_sampled(self) -> "Sample":
    """This sample up to its last sampled token (itself when nothing was sampled)."""
    n = max((i + 1 for i, m in enumerate(self.loss_mask) if m), default=len(self.loss_mask))
    return Sample(self.token_ids[:n], self.loss_mask[:n], self.logprobs[:n], self.versions[:n])


class Stitcher:
  """Builds the training samples of one episode (see the module docstring).

      ids = st.start(chat)                       # the first prompt
      content = st.sampled(comp_ids, logprobs, version)   # the turn's text for the chat
      ids = st.extend(chat + [assistant(content)] + env_messages)   # the next prompt
  """

  def __init__(self, tokenizer, tools: Optional[list[dict[str, Any]]] = None,
               mode: str = "tokens", stop_token_ids: Sequence[int] = ()):
    if mode not in STITCH_MODES:
      raise ValueError(f"stitch mode {mode!r}; valid: {STITCH_MODES}")
    self.tok, self.tools, self.mode = tokenizer, tools or None, mode
    self.stop_ids = set(int(t) for t in stop_token_ids)
    self.samples: list[Sample] = []
    self.breaks: collections.Counter = collections.Counter()
    self._text = ""                 # the current sample's stream as text
    self._turn_start = 0            # where the last sampled turn starts in self._text

  # -- rendering ------------------------------------------------------------------------------

  def render(self, chat: list[dict[str, Any]]) -> str:
    return self.tok.apply_chat_template(chat, tools=self.tools, add_generation_prompt=True,
                                        tokenize=False)

  def encode(self, text: str) -> list[int]:
    return list(self.tok(text, add_special_tokens=False)["input_ids"])

  def decode(self, ids: Sequence[int]) -> str:
    return self.tok.decode(list(ids), skip_special_tokens=False,
                           clean_up_tokenization_spaces=False)

  # -- the stream -----------------------------------------------------------------------------

  @property
  def stream(self) -> list[int]:
    """The ids of the current sample (the next prompt after `start` / `extend`)."""
    return self.samples[-1].token_ids

  def start(self, chat: list[dict[str, Any]]) -> list[int]:
    text = self.render(chat)
    self._new_sample(text, self.encode(text))
    return self.stream

  def sampled(self, ids: Sequence[int], logprobs: Sequence[float], version: int) -> str:
    """Appends a sampled turn; returns its text without a final stop token (the assistant
    message's content, which the template renders back followed by its end-of-turn)."""
    self.samples[-1].add(ids, logprobs, version)
    self._turn_start = len(self._text)
    self._text += self.decode(ids)
    body = list(ids)
    if body and body[-1] in self.stop_ids:
      body = body[:-1]
    return self.decode(body)

  def extend(self, chat: list[dict[str, Any]]) -> list[int]:
    """The next prompt for `chat` (it holds every message so far, the sampled turns as their
    content); appends glue, or starts a new sample and counts the break."""
    text = self.render(chat)
    stream = self.stream
    if self.mode == "tokens":
      if text.startswith(self._text):
        glue = self.encode(text[len(self._text):])
        self.samples[-1].add(glue)
        self._text = text
        return self.stream
      reason = self._text_break(text)
      ids = self.encode(text)
    else:
      ids = self.encode(text)
      if ids[:len(stream)] == stream:
        self.samples[-1].add(ids[len(stream):])
        self._text = text
        return self.stream
      reason = "retokenized" if text.startswith(self._text) else self._text_break(text)
    self.breaks[reason] += 1
    self._new_sample(text, ids)
    return self.stream

  def _text_break(self, text: str) -> str:
    old = self._text
    if old.count("</think>") > text.count("</think>"):
      return "thinking_stripped"
    common = 0
    for a, b in zip(old, text):
      if a != b:
        break
      common += 1
    return "rerendered_turn" if common >= self._turn_start else "history_edited"

  def _new_sample(self, text: str, ids: list[int]) -> None:
    s = Sample()
    s.add(ids)
    self.samples.append(s)
    self._text, self._turn_start = text, len(text)
