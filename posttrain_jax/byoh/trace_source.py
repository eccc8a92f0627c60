"""Learning from recorded traces: a rollout source that reads graded (or commented) sessions.

`rl.mode = "traces"` trains on what a harness already did through the proxy: sessions that can
never be replayed, so there is no group to compare with. Each step takes up to
`prompts_per_step` graded sessions not trained on yet (oldest grade first), rebuilds each into
its samples (rebuild.py: the recorded ids, mask 1 on what was sampled, the session's grade as
reward), and hands them to the same RL step as every other source. With one trajectory per
task the baseline is the `running` estimator's; the off-policy correction of the loss works on
the recorded behaviour log-probs, which may be many versions old. How old is reported per step:
`traces/staleness/{mean,p50,max}` over sampled tokens (current version − the version that
sampled the token).

A session is taken once it has what `require` asks for and its last call is `settle_s` old
(online, a running session may still grow): "grade" a session-level grade; "feedback" any
free-text feedback (session- or call-level; for a distillation loss, whose teacher reads it);
"either" one of the two. A session with text but no grade is *ungraded*: its samples have reward
None, which advantages.py gives A = 0 and leaves out of every baseline (RunConfig allows
`require` other than "grade" only with a distillation loss); it is counted per step as
`traces/ungraded`. A session is taken once: a grade posted after its text made it ready is
not seen (a `settle_s` longer than the grading delay waits for it).

A step waits up to `wait_s` for `prompts_per_step` ready sessions and then trains on those
there are; with none, it trains on nothing (rl_step leaves the weights untouched on an empty
batch). With `max_staleness` ≥ 0, a session whose oldest sampled token is
more than that many versions old is taken but not trained, and the share of such sessions is
logged per step as `filter/stale_session_frac` (the audit watches every filter's share).
`sessions` names a curated set (byoh/triage.py: "the sessions with feedback", "failure mode X"):
only the sessions it lists are taken. The sessions taken are part of the checkpoint (`state()`),
so a resumed run never trains on a session twice.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Optional

import numpy as np

from posttrain_jax.actors.source import SourceBase, check_kind
from posttrain_jax.byoh.online import OnlineConfig
from posttrain_jax.byoh.rebuild import rebuild_session, session_grade
from posttrain_jax.byoh.store import StoreConfig, TraceStore
from posttrain_jax.tasks.task import Task
from posttrain_jax.types import Trajectory


REQUIRE = ("grade", "feedback", "either")


@dataclasses.dataclass(frozen=True)
class TraceSourceConfig:
  """Which recorded sessions a run trains on, and how long it waits for them."""
  store: StoreConfig = StoreConfig()    # the trace store the proxy records into
  tenant: Optional[str] = None          # one tenant's sessions; None = every tenant's
  settle_s: float = 0.0                 # a session is ready once its last call is this old
  wait_s: float = 0.0                   # a step waits up to this long for prompts_per_step
                                        # ready sessions, then trains on those there are
  poll_s: float = 0.25                  # how often it looks while waiting
  max_staleness: int = -1               # a session sampled more than this many versions ago is
                                        # taken but not trained (counted: filter/stale_session_frac);
                                        # -1 = train on every session however old
  online: OnlineConfig = OnlineConfig()  # serve the run's policy while training (online.py)
  require: str = "grade"                # which sessions are ready: "grade" (a session grade),
                                        # "feedback" (any free text), "either"; sessions without
                                        # a grade train with advantage 0 (a distillation loss)
  sessions: str = ""                    # a session set file (launch/triage.py writes them:
                                        # sets/feedback.jsonl, sets/mode_<mode>.jsonl, ...): only
                                        # its sessions are taken; "" = every session

  def __post_init__(self):
    if self.require not in REQUIRE:
      raise ValueError(f"TraceSourceConfig.require is {self.require!r}; valid: {REQUIRE}")
    for name in ("settle_s", "wait_s", "poll_s"):
      if getattr(self, name) < 0:
        raise ValueError(f"TraceSourceConfig.{name} must be ≥ 0, got {getattr(self, name)}")


class TraceRollouts(SourceBase):
  """The rollout-source protocol (actors/source.py) over a store: recorded samples of whatever
  policy served them (`off_policy`), each session its own task (no `repeats_tasks`).

  `engine`: where new weights go (online: the proxy's engine, hot-swapped); may be None."""
  off_policy = True
  repeats_tasks = False

  def __init__(self, cfg: TraceSourceConfig, sessions_per_step: int, engine=None,
               store: Optional[TraceStore] = None, clock: Callable[[], float] = time.time,
               sleep: Callable[[float], None] = time.sleep, copy_weights: bool = False,
               server=None):
    self.cfg, self.per_step, self.engine = cfg, sessions_per_step, engine
    self.copy_weights = copy_weights   # the engine serves while the learner donates buffers
    self.server = server               # online: the OnlineServer serving `engine`
    self.store = store or TraceStore(cfg.store)
    self.closed_at: Optional[float] = None
    self._clock, self._sleep = clock, sleep
    self.version = 0
    self._taken: set[tuple[str, str]] = set()
    self._only: Optional[set[tuple[str, str]]] = None
    if cfg.sessions:
      from posttrain_jax.byoh.triage import read_set
      self._only = read_set(cfg.sessions)
    self._metrics: dict[str, float] = {}
    self._backlog = 0                  # ready sessions the last collect left untrained
    self._totals: collections.Counter = collections.Counter()

  def update_weights(self, params, version: int) -> None:
    self.version = version
    if self.engine is not None:
      if self.copy_weights:
        import jax
        import jax.numpy as jnp
        params = jax.tree.map(jnp.copy, params)
      self.engine.update_weights(params, version)
    if self.server is not None:        # online: the proxy's backpressure (byoh/backpressure.py)
      self.server.proxy.gate.report(version, self._backlog)

  def _counts(self, fb) -> bool:
    """Whether feedback row `fb` makes its session ready under `require`."""
    grade = fb.call_id is None and fb.grade is not None
    text = bool(fb.text)
    return {"grade": grade, "feedback": text, "either": grade or text}[self.cfg.require]

  def _ready(self) -> list[tuple[float, str, str]]:
    """(time, tenant, session) of ready (`require`), settled sessions not taken yet, oldest
    first; time = that of the latest feedback row that counts."""
    tenants = [self.cfg.tenant] if self.cfg.tenant else self.store.tenants()
    now, out = self._clock(), []
    for tenant in tenants:
      ready: dict[str, float] = {}
      for fb in self.store.feedback(tenant):
        if self._counts(fb):
          ready[fb.session] = fb.created           # the latest such row's time
      for s in self.store.sessions(tenant):
        key = (tenant, s["id"])
        if key in self._taken or s["id"] not in ready or (
            self._only is not None and key not in self._only):
          continue
        if now - s["last_call"] >= self.cfg.settle_s:
          out.append((ready[s["id"]], tenant, s["id"]))
    return sorted(out)

  def collect(self, step: int) -> tuple[list[Task], list[Trajectory]]:
    ready = self._ready()
    deadline = self._clock() + self.cfg.wait_s
    while len(ready) < self.per_step and self._clock() < deadline:
      self._sleep(self.cfg.poll_s)
      ready = self._ready()
    return self._take(ready)

  def _take(self, ready: list[tuple[float, str, str]]) -> tuple[list[Task], list[Trajectory]]:
    """Rebuilds up to `per_step` of the `ready` sessions (oldest first) into trajectories."""
    tasks, trajs, counts = [], [], collections.Counter()
    used = 0
    for _, tenant, session in ready:
      if used == self.per_step:
        break
      self._taken.add((tenant, session))
      feedback = self.store.feedback(tenant, session)
      samples, stats = rebuild_session(session, self.store.calls(tenant, session), feedback)
      oldest = max((self.version - v for t in samples
                    for v, m in zip(t.policy_version, t.loss_mask) if m), default=0)
      if 0 <= self.cfg.max_staleness < oldest:
        counts["dropped_stale"] += 1
        continue
      used += 1
      counts.update(stats)
      counts["sessions"] += 1
      counts["ungraded"] += int(session_grade(feedback) is None)
      if not samples:
        counts["sessions_without_samples"] += 1
        continue
      tasks.append(Task(id=f"{tenant}/{session}", prompt=session, answer="",
                        metadata={"grade": session_grade(feedback)}))
      trajs += samples
    stale = [self.version - v for t in trajs for v, m in zip(t.policy_version, t.loss_mask) if m]
    self._totals.update(counts)
    self._metrics = {f"traces/{k}": float(v) for k, v in counts.items()}
    seen = counts["sessions"] + counts["dropped_stale"]
    self._backlog = max(len(ready) - seen, 0)
    self._metrics.update({
        "filter/stale_session_frac": counts["dropped_stale"] / seen if seen else 0.0,
        "traces/backlog": float(self._backlog),
        "traces/total/sessions": float(self._totals["sessions"]),
        "traces/staleness/mean": float(np.mean(stale)) if stale else float("nan"),
        "traces/staleness/p50": float(np.median(stale)) if stale else float("nan"),
        "traces/staleness/max": float(np.max(stale)) if stale else float("nan"),
    })
    return tasks, trajs

  def metrics(self) -> dict[str, float]:
    return dict(self._metrics)

  def state(self) -> dict[str, Any]:
    return {"kind": "traces", "taken": sorted(list(k) for k in self._taken),
            "totals": dict(self._totals)}

  def restore(self, state: dict) -> None:
    if not check_kind(state, "traces"):
      return
    self._taken = {tuple(k) for k in state["taken"]}
    self._totals = collections.Counter(state["totals"])

  def close(self) -> None:
    if self.server is not None:
      self.closed_at = time.time()   # when online serving began to stop (benchmarks read it)
      self.server.close()
      self.server = None
