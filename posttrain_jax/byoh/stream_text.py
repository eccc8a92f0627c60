"""Streaming text that is sure to stay: what a streamed chat call sends as its tokens arrive."""
from __future__ import annotations

from typing import Optional


class StreamText:
  """One choice's text as its tokens arrive. `feed` returns the new text that is sure to begin
  the final content, and the new sampled tokens the answer keeps, with their log-probs: every
  token up to the one that ended it (a stop token, or the token completing a stop string),
  as `Proxy.choice` keeps them. Text is held back where it could still change: the stop
  token's text is never content; an incomplete UTF-8 character waits for the rest; and the
  last len(longest stop string) - 1 characters wait, so a stop string completed later cuts the
  content before anything already sent. Decoding is incremental (a window of the last tokens),
  so a long answer costs O(tokens), not O(tokens^2)."""

  def __init__(self, decode, stop_ids: tuple[int, ...]):
    self.decode, self.stop_ids = decode, set(stop_ids)
    self.ids: list[int] = []        # the content's ids so far (a stop token excluded)
    self.text = ""                  # their text, decoded incrementally
    self.sent = ""
    self.ended = False              # a stop token or stop string ended the content
    self._seen = 0                  # sampled tokens consumed
    self._prefix = self._read = 0   # the decode window: ids[_prefix:_read] is already text

  def _grow(self) -> None:
    before = self.decode(self.ids[self._prefix:self._read])
    now = self.decode(self.ids[self._prefix:])
    if len(now) > len(before) and not now.endswith("\ufffd"):
      self.text += now[len(before):]
      self._prefix, self._read = self._read, len(self.ids)

  def feed(self, token_ids: list[int], logprobs: list[float],
           stops: tuple[str, ...]) -> tuple[str, list[tuple[int, float]]]:
    kept = []
    for t in range(self._seen, len(token_ids)):
      self._seen += 1
      if self.ended:
        continue
      kept.append((int(token_ids[t]), float(logprobs[t])))
      if token_ids[t] in self.stop_ids:
        self.ended = True
        continue
      self.ids.append(int(token_ids[t]))
      old = len(self.text)
      self._grow()
      if any(s in self.text[max(old - len(s) + 1, 0):] for s in stops):
        self.ended = True           # the content ends before it: `rest` sends what is left
    if self.ended:
      return "", kept
    hold = max((len(s) for s in stops), default=1) - 1
    ready = self.text[:len(self.text) - hold] if hold else self.text
    if len(ready) <= len(self.sent) or not ready.startswith(self.sent):
      return "", kept
    piece, self.sent = ready[len(self.sent):], ready
    return piece, kept

  def rest(self, content: str) -> Optional[str]:
    """What of the final `content` is still to send; None if what was sent does not begin it
    (a tokenizer whose text of a prefix is not a prefix of the text: counted by the caller)."""
    return content[len(self.sent):] if content.startswith(self.sent) else None
