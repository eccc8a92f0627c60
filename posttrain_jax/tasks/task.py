"""The `Task` record: one prompt with its reference answer, as the task bank yields it.

A task is what an actor samples G completions for and a grader scores:

    Task(id="arith:12+7", prompt="12+7=", answer="19", metadata={"solution": "19"})

`prompt` is either plain text or a chat in OpenAI format (a list of
`{"role": ..., "content": ...}` messages). `answer` is always a string (numbers are
stored as their text), the grader decides how to read it. `metadata` carries whatever
else the source row had (e.g. `numbers`/`target` for countdown, `solution` for SFT).
Tasks round-trip through JSON with `to_dict` / `from_dict`.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Union

Messages = list[dict[str, Any]]
Prompt = Union[str, Messages]


class TaskError(ValueError):
  """A malformed task; the message names the task and the field."""


@dataclasses.dataclass(frozen=True)
class Task:
  """One single-turn task: a prompt and the reference answer the grader compares with."""
  id: str                                     # stable identity (task_id in a Trajectory)
  prompt: Prompt                              # plain text, or chat [{"role", "content"}, ...]
  answer: str                                 # reference answer as text ("19", "... #### 72")
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)  # the rest of the row

  def __post_init__(self):
    if not isinstance(self.id, str) or not self.id:
      raise TaskError(f"task id must be a non-empty string, got {self.id!r}")
    check_prompt(self.prompt, where=f"task {self.id!r}")
    if not isinstance(self.answer, str):
      raise TaskError(f"task {self.id!r}: field 'answer' must be a string, got "
                      f"{type(self.answer).__name__}")
    if not isinstance(self.metadata, dict):
      raise TaskError(f"task {self.id!r}: field 'metadata' must be a dict")

  @property
  def prompt_text(self) -> str:
    """The prompt as one string (chat contents joined by newlines), for logs and tokenizers."""
    if isinstance(self.prompt, str):
      return self.prompt
    return "\n".join(str(m.get("content", "")) for m in self.prompt)

  @property
  def messages(self) -> Messages:
    """The prompt as chat messages (a plain prompt becomes one user message)."""
    if isinstance(self.prompt, str):
      return [{"role": "user", "content": self.prompt}]
    return [dict(m) for m in self.prompt]

  def to_dict(self) -> dict[str, Any]:
    return {"id": self.id, "prompt": self.prompt, "answer": self.answer,
            "metadata": dict(self.metadata)}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "Task":
    if not isinstance(d, dict):
      raise TaskError(f"a task must be a JSON object, got {type(d).__name__}")
    missing = [k for k in ("id", "prompt", "answer") if k not in d]
    if missing:
      raise TaskError(f"task {d.get('id')!r} is missing field(s) {missing}")
    unknown = sorted(set(d) - {"id", "prompt", "answer", "metadata"})
    if unknown:
      raise TaskError(f"unknown task field(s) {unknown}; known: id, prompt, answer, metadata")
    return cls(id=d["id"], prompt=d["prompt"], answer=d["answer"],
               metadata=dict(d.get("metadata") or {}))


def check_prompt(prompt: Any, where: str) -> None:
  """Raises TaskError unless `prompt` is a string or a list of {"role", "content"} messages."""
  if isinstance(prompt, str):
    return
  if not isinstance(prompt, list) or not prompt:
    raise TaskError(f"{where}: prompt must be a string or a non-empty list of chat messages, "
                    f"got {type(prompt).__name__}")
  for i, m in enumerate(prompt):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
      raise TaskError(f"{where}: prompt message {i} must be an object with string 'role' and "
                      f"'content', got {m!r:.80}")


_HELD_OUT_SALT = b"posttrain_jax/held-out/v1:"


def is_held_out(key: str, fraction: float) -> bool:
  """Whether `key` falls in the held-out split of size `fraction`.

  A fixed hash (blake2b) of the key, independent of any seed, of the process and of the order
  of the data: the same key is on the same side in every run, so an evaluation set built with
  one seed never leaks into a training stream built with another.
  """
  if fraction <= 0.0:
    return False
  digest = hashlib.blake2b(_HELD_OUT_SALT + key.encode("utf-8"), digest_size=8).digest()
  return int.from_bytes(digest, "big") < fraction * 2.0**64
