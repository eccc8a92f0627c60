"""The records that flow between actors, replay queue and learner.

`Trajectory` is the canonical, JSONL-serialisable record of one graded chat (see
ARCHITECTURE.md). `TrainBatch` is its dense, padded/packed array form for the learner.
`TrainState` is the learner's explicit state.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
from typing import Any, Optional

import jax
import numpy as np

SCHEMA_VERSION = 1


class Status(str, enum.Enum):
  """How a rollout ended. See ARCHITECTURE.md for what the learner does with each."""
  OK = "ok"
  INFRA_ERROR = "infra_error"   # our side failed: never scored, never in a baseline, retried
  TIMEOUT = "timeout"           # the policy exhausted a budget: scored as a failure, never dropped
  TRUNCATED = "truncated"       # hit max tokens: masked or penalised per config, always counted


class Source(str, enum.Enum):
  TASK_BANK = "task_bank"
  ENV = "env"
  BYOH = "byoh"


class TrajectoryError(ValueError):
  """A malformed trajectory; the message names the field."""


@dataclasses.dataclass
class Trajectory:
  """One graded chat, token-exact.

  `token_ids` is the whole sequence (prompt + every turn); `loss_mask[t] = 1` only on tokens
  the policy sampled; `behaviour_logprobs[t]` is the engine-reported log-prob of token t
  (0.0 where the mask is 0); `policy_version[t]` the weights version that sampled it (-1 where
  the mask is 0).
  """
  id: str
  task_id: str
  token_ids: list[int]
  loss_mask: list[int]
  behaviour_logprobs: list[float]
  policy_version: list[int]
  group_id: Optional[str] = None
  source: Source = Source.TASK_BANK
  messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  tools: Optional[list[dict[str, Any]]] = None   # the tools (OpenAI format) the chat was rendered with
  reward: Optional[float] = None
  feedback: Optional[str] = None
  status: Status = Status.OK
  metrics: dict[str, Any] = dataclasses.field(default_factory=dict)  # latencies, counts, errors
  schema_version: int = SCHEMA_VERSION

  def __post_init__(self):
    self.status = _enum(Status, self.status, "status")
    self.source = _enum(Source, self.source, "source")
    n = len(self.token_ids)
    for name in ("loss_mask", "behaviour_logprobs", "policy_version"):
      if len(getattr(self, name)) != n:
        raise TrajectoryError(
            f"trajectory {self.id!r}: field {name!r} has length {len(getattr(self, name))}, "
            f"token_ids has {n}")
    if any(m not in (0, 1) for m in self.loss_mask):
      raise TrajectoryError(f"trajectory {self.id!r}: field 'loss_mask' must hold only 0/1")
    if self.reward is not None and not math.isfinite(self.reward):
      raise TrajectoryError(f"trajectory {self.id!r}: field 'reward' is {self.reward}")
    if self.schema_version > SCHEMA_VERSION:
      raise TrajectoryError(
          f"trajectory {self.id!r}: schema_version {self.schema_version} is newer than this "
          f"code's {SCHEMA_VERSION}; upgrade posttrain_jax")

  @property
  def num_sampled(self) -> int:
    return int(sum(self.loss_mask))

  @property
  def prompt_len(self) -> int:
    """Tokens before the first sampled token."""
    for i, m in enumerate(self.loss_mask):
      if m:
        return i
    return len(self.loss_mask)

  @property
  def trainable(self) -> bool:
    """Infra errors never reach the loss; everything else does (timeouts included)."""
    return self.status is not Status.INFRA_ERROR

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["status"] = self.status.value
    d["source"] = self.source.value
    return d

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), separators=(",", ":"))

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "Trajectory":
    if not isinstance(d, dict):
      raise TrajectoryError(f"a trajectory must be a JSON object, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise TrajectoryError(f"unknown trajectory field(s) {unknown}; known: {sorted(names)}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in d]
    if missing:
      raise TrajectoryError(f"trajectory {d.get('id')!r} is missing field(s) {missing}")
    return cls(**d)

  @classmethod
  def from_json(cls, line: str) -> "Trajectory":
    try:
      d = json.loads(line)
    except json.JSONDecodeError as e:
      raise TrajectoryError(f"not valid JSON: {e}") from None
    return cls.from_dict(d)


def _enum(enum_cls, value, field):
  try:
    return enum_cls(value)
  except ValueError:
    valid = [e.value for e in enum_cls]
    raise TrajectoryError(f"field {field!r} is {value!r}; valid: {valid}") from None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainBatch:
  """Dense learner input; every `_bt` array is `[batch, time]`.

  Position t predicts `target_ids[b, t]` from `input_ids[b, :t+1]`. Several sequences may be
  packed in one row: `segment_ids` (0 = padding) keeps attention inside a sequence and
  `positions` restarts at 0 per sequence. `prefix_ids` lets sequences of one group share
  their prompt's slots (batching.py, `BatchConfig.share_prefix`): a slot also attends the
  earlier slots of segment `prefix_ids` (0 = none), so a group's prompt is computed once. `seq_ids` gives each token the global index of its
  sequence in `[0, num_seqs)` so sequence-level losses are layout independent (packed ==
  unpacked). Optional log-prob fields are None when a loss does not need them.
  """
  input_ids: jax.Array          # int32 [B, T]
  target_ids: jax.Array         # int32 [B, T]
  loss_mask: jax.Array          # float32 [B, T]; 1 on sampled target tokens
  positions: jax.Array          # int32 [B, T]
  segment_ids: jax.Array        # int32 [B, T]; 0 on padding
  seq_ids: jax.Array            # int32 [B, T]; global sequence index (any value where mask=0)
  seq_valid: jax.Array          # float32 [S]; 1 for sequences present; S is the static count
  advantages: jax.Array         # float32 [B, T]; per-token advantage
  behaviour_logp: Optional[jax.Array] = None   # [B, T] log mu(y_t), as the engine reported
  old_logp: Optional[jax.Array] = None         # [B, T] log pi_old(y_t), recomputed by the learner
  ref_logp: Optional[jax.Array] = None         # [B, T] log pi_ref(y_t), frozen reference
  teacher_logp: Optional[jax.Array] = None     # [B, T] log T(y_t), a teacher's score
  teacher_mask: Optional[jax.Array] = None     # [B, T] 1 where a teacher scored the token
  teacher_hidden: Optional[jax.Array] = None   # [B, T, D] the teacher's final hidden state there
  prefix_ids: Optional[jax.Array] = None       # int32 [B, T]; shared prefix's segment, 0 = none

  @property
  def num_seqs(self) -> int:
    return self.seq_valid.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  """Everything the learner carries from step to step."""
  params: Any
  opt_state: Any
  step: jax.Array
  rng: jax.Array


def np_batch(**fields) -> TrainBatch:
  """Builds a TrainBatch from numpy arrays, casting to the dtypes the learner expects."""
  ints = {"input_ids", "target_ids", "positions", "segment_ids", "seq_ids", "prefix_ids"}
  out = {k: (None if v is None else np.asarray(v, np.int32 if k in ints else np.float32))
         for k, v in fields.items()}
  return TrainBatch(**out)
