"""A new episode type drops into both rollout sources through the registry alone: a two-turn
episode (sample, a masked "tool result", sample again) defined here runs in a sync and an async
training run without any change to the pool, the sources or the trainer."""
import dataclasses

import pytest

from posttrain_jax.actors.episode import (EngineLimits, EpisodeContext, WorkItem, episode_spec,
                                          register_episode)
from posttrain_jax.actors.rollout import encode_prompt
from posttrain_jax.metrics import read_metrics
from posttrain_jax.run import Trainer
from posttrain_jax.types import Source, Status, Trajectory
from tests.support.runs import tiny_run
from tests.support.runs import async_run

TOOL_RESULT = [7, 8, 9]   # stands in for a tool's output: template glue, never trained on


@dataclasses.dataclass(frozen=True)
class TwoTurnConfig:
  turns: int = 2          # sampled turns per episode


class TwoTurn:
  def __init__(self, cfg: TwoTurnConfig, ctx: EpisodeContext):
    self.cfg, self.ctx, self.engine = cfg, ctx, ctx.engine

  def run(self, items, seed):
    ctx, g = self.ctx, self.ctx.rollout.group_size
    sampling = ctx.rollout.sampling(ctx.stop_token_ids)
    seqs = [(list(p), [0] * len(p), [0.0] * len(p), [-1] * len(p))
            for it in items for p in [encode_prompt(ctx.tokenizer, it.task)] for _ in range(g)]
    text = [""] * len(seqs)
    for turn in range(self.cfg.turns):
      outs = self.engine.generate([s[0] for s in seqs], sampling, n=1, seed=seed + turn)
      for i, (comp,) in enumerate(outs):
        ids, mask, lp, ver = seqs[i]
        ids += comp.token_ids
        mask += [1] * len(comp.token_ids)
        lp += comp.logprobs
        ver += [comp.version] * len(comp.token_ids)
        text[i] = ctx.tokenizer.decode(comp.token_ids, skip_special_tokens=True)
        if turn + 1 < self.cfg.turns:
          ids += TOOL_RESULT
          mask += [0] * len(TOOL_RESULT)
          lp += [0.0] * len(TOOL_RESULT)
          ver += [-1] * len(TOOL_RESULT)
    out = []
    for k, item in enumerate(items):
      group = []
      for j in range(g):
        ids, mask, lp, ver = seqs[k * g + j]
        group.append(Trajectory(
            id=f"{item.group_id}/{j}", task_id=item.task.id, group_id=item.group_id,
            source=Source.ENV, token_ids=ids, loss_mask=mask, behaviour_logprobs=lp,
            policy_version=ver, reward=ctx.grader(text[k * g + j], item.task).reward,
            status=Status.OK, metrics={"turns": float(self.cfg.turns)}))
      out.append(group)
    return out


def _evaluate(episode, tasks, temperature, n, max_tokens, seed):
  """Its own whole episodes on the held-out tasks (not the single-turn eval)."""
  del max_tokens
  rollout = dataclasses.replace(episode.ctx.rollout, group_size=n, temperature=temperature)
  ev = TwoTurn(episode.cfg, dataclasses.replace(episode.ctx, rollout=rollout))
  groups = ev.run([WorkItem(-1 - i, t) for i, t in enumerate(tasks)], seed)
  rewards = [t.reward for g in groups for t in g]
  return {"accuracy": sum(rewards) / len(rewards), "count": float(len(rewards)),
          "turns": float(episode.cfg.turns)}


def _limits(cfg, rollout, eval_max_tokens, longest_prompt):
  """A later turn's prompt holds the earlier turns and tool results."""
  del eval_max_tokens
  turns = cfg.turns - 1
  return EngineLimits(longest_prompt() + turns * (rollout.max_tokens + len(TOOL_RESULT)),
                      rollout.max_tokens, rollout.max_tokens)


@register_episode("test_two_turn", TwoTurnConfig, evaluate=_evaluate, limits=_limits,
                  demonstration=episode_spec("task").demonstration)
def _build(cfg, ctx):
  return TwoTurn(cfg, ctx)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.slow  # > 30 s: CI's slow stage
def test_a_registered_episode_type_runs_in_both_sources(tmp_path, mode):
  base = tiny_run(tmp_path, sft={"steps": 0}) if mode == "sync" else async_run(tmp_path)
  rl = base.rl
  cfg = dataclasses.replace(base, rl=dataclasses.replace(
      rl, episode="test_two_turn", episode_config=TwoTurnConfig(turns=2), steps=2,
      rollout=dataclasses.replace(rl.rollout, max_tokens=3),
      batch=dataclasses.replace(rl.batch, seq_len=40)))
  assert Trainer(cfg, log=lambda *_: None).run() is not None
  rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "reward/mean" in r]
  assert len(rows) == 2 and all(r["skipped_update"] == 0.0 for r in rows)
  assert all(r["response_len/mean"] > 0 for r in rows)
  # tiny_run evaluates sampled only (eval.greedy=False): the episode's own eval reports `turns`
  evals = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "eval/accuracy" in r]
  assert evals and all(r["eval/accuracy/turns"] == 2.0 for r in evals)   # its own eval
