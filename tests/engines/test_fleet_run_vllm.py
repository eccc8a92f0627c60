"""Issue S must-show: GRPO with rl.engine='fleet' on two real local vLLM servers; one is killed
(kill -9, its process group) with step 3's request in flight. The run goes on on the other:
the killed server's rollouts are infra_error (no reward, not 0), their task is requeued and run
again first, every step trains, the killed server is taken out of the fleet, and the learner's
log-probs equal the servers' at every step."""
import threading

import numpy as np
import pytest

from tests.support import vllm as vt
from tests.support.engines import KillingProxy


@pytest.mark.slow  # ~5 min: two vLLM servers start, then a 6-step run
@vt.needs_vllm
def test_a_run_goes_on_on_the_other_server(tmp_path, monkeypatch):
  from posttrain_jax.actors.rollout import SyncRollouts
  from posttrain_jax.engines.vllm_server import LocalServerConfig, LocalVLLMServer
  from posttrain_jax.metrics import read_metrics
  from posttrain_jax.run import Trainer
  from posttrain_jax.types import Status
  from tests.support.runs import tiny_run
  from tests.support.vllm import TINY_FIELDS

  collected = []                   # a spy: what the real source returned, step by step
  real_collect = SyncRollouts.collect

  def spy(self, step):
    tasks, trajs = real_collect(self, step)
    collected.append((tasks, trajs))
    return tasks, trajs

  monkeypatch.setattr(SyncRollouts, "collect", spy)
  with vt.vllm_environment(tmp_path / "vllm_env"):
    tiny = vt.tiny_model_dir(tmp_path)
    servers = [LocalVLLMServer(LocalServerConfig(
        model=str(tiny), dtype="float32", max_model_len=256, enforce_eager=True,
        log_path=str(tmp_path / f"server{i}.log"), max_restarts=1)) for i in range(2)]
    starters = [threading.Thread(target=s.start) for s in servers]
    for t in starters:
      t.start()
    for t in starters:
      t.join()
    try:
      # kills server 1 as step 3's request to it is sent (4 tokens: it would answer in < 50 ms)
      proxy = KillingProxy(servers[1], kill_first=True)
      workdir = tmp_path / "run"
      cfg = tiny_run(workdir, model={"tiny": {**TINY_FIELDS, "corpus_lines": 500}},
                     rl={"steps": 6, "prompts_per_step": 2, "engine": "fleet",
                         "engine_config": {"urls": [servers[0].url, proxy.url],
                                           "health_interval_s": 0.5,
                                           "server": {"max_retries": 0,
                                                      "weights_dir": str(tmp_path / "weights")}},
                         "rollout": {"group_size": 4, "max_tokens": 4},
                         "learner": {"loss": "grpo", "optimizer": {"learning_rate": 1e-3}},
                         "batch": {"rows": 8, "seq_len": 32, "max_seqs": 8, "pack": False}},
                     # held-out eval before and after RL only: the first request after step 2
                     # is then step 3's rollout, not an eval's
                     eval={"every_steps": 100, "samples_per_prompt": 1, "max_tokens": 4,
                           "greedy": False})

      proxy.arm_after_step(workdir, 2)
      result = Trainer(cfg, log=lambda *_: None).run()
      proxy.close()
      assert proxy.killed_pid is not None, "the server was never killed"
    finally:
      for s in servers:
        s.close()

  rows = [r for r in read_metrics(workdir / "metrics.jsonl") if "reward/mean" in r]
  print("\n" + "\n".join(
      f"v{r['policy_version']}: infra {r['status/infra_error_frac']:.2f} requeued "
      f"{r['rollout/requeued']:.0f} servers up {r['fleet/servers_up']:.0f} "
      f"requests {r['fleet/0/requests']:.0f}/{r['fleet/1/requests']:.0f} "
      f"|dlogp| {r['correction/abs_logp_diff']:.1e}" for r in rows))
  assert [r["policy_version"] for r in rows] == [1, 2, 3, 4, 5, 6]
  by_step = {r["policy_version"]: r for r in rows}
  assert by_step[3]["status/infra_error_frac"] == 0.5 and by_step[3]["rollout/requeued"] == 1
  assert all(by_step[v]["status/infra_error_frac"] == 0 for v in (1, 2, 4, 5, 6))
  assert all(r["rollout/engine_errors"] == 0 for r in rows)   # the survivor answered
  assert max(r["correction/abs_logp_diff"] for r in rows) < 1e-3
  assert np.isfinite(result["heldout_after"])

  # the killed server's group: infra_error, no tokens sampled, no reward (not 0); its task is
  # the first task of the next step, and there it is graded like any other
  assert len(collected) == 6
  tasks3, trajs3 = collected[2]     # RL step 3
  infra = [t for t in trajs3 if t.status is Status.INFRA_ERROR]
  assert len(infra) == 4 and len({t.task_id for t in infra}) == 1
  assert all(t.reward is None and sum(t.loss_mask) == 0 for t in infra)
  assert all(t.reward is not None for t in trajs3 if t.status is not Status.INFRA_ERROR)
  tasks4, trajs4 = collected[3]
  lost = next(task for task in tasks3 if task.id == infra[0].task_id)
  assert tasks4[0] == lost
  assert all(t.status is not Status.INFRA_ERROR and t.reward is not None for t in trajs4)
  # taken out once; its readmission after the restart is tests/engines/test_fleet_vllm.py's (the run
  # may end before the restarted server is up)
  assert rows[-1]["fleet/1/taken_out"] == 1 and by_step[4]["fleet/1/up"] == 0
