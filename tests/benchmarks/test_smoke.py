"""Every benchmark runs at `--smoke` size, so none can rot unseen (benchmarks/fidelity.py once
raised TypeError on every RL run for days because nothing ran it): exit 0, a final `RESULT` line,
and a JSON whose "run" record (benchmarks/_meta.py) says it was a smoke run of this commit.
Marked `bench`: CI runs them as their own tier (`pytest -m bench`) after the vLLM install, so
the benchmarks that compare against vLLM run that side too."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_"))
# arguments a smoke run needs beyond --smoke --out ({tmp}: the test's own directory)
EXTRA = {
    "fidelity": ["--workdir", "{tmp}/fidelity"],
    "chaos_resume": ["--workdir", "{tmp}/chaos"],
    "default_run": ["--workdir", "{tmp}/default_run"],
    "run_all": ["--only", "proxy_overhead"],
}


def _as_a_user_runs_it(env: dict) -> dict:
  """The environment without the 8 host devices tests/conftest.py gives the test process: a
  benchmark runs on the devices a user has (the ones that need several set them themselves)."""
  flags = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                   if not f.startswith("--xla_force_host_platform_device_count"))
  return {**env, "XLA_FLAGS": flags}


def _run(cmd, tmp_path, env=None):
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                        env=_as_a_user_runs_it({**os.environ, **(env or {})}))
  assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
  lines = proc.stdout.strip().splitlines()
  assert lines and lines[-1].startswith("RESULT "), proc.stdout[-2000:]
  return lines[-1]


@pytest.mark.bench
@pytest.mark.parametrize("name", SCRIPTS)
def test_every_benchmark_runs_at_smoke_size(name, tmp_path):
  out = tmp_path / f"{name}.json"
  extra = [a.format(tmp=tmp_path) for a in EXTRA.get(name, [])]
  _run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--smoke", "--out", str(out),
        *extra], tmp_path)
  doc = json.loads(out.read_text())
  run = doc["run"]
  assert run["smoke"] is True and run["commit"] and run["versions"]["python"]
  assert run["command"].endswith(" ".join(["--smoke", "--out", str(out), *extra]))


@pytest.mark.bench
def test_the_gpu_check_script_dry_runs_on_a_cpu(tmp_path):
  last = _run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path)], tmp_path,
              env={"GPU_CHECK_CPU": "1", "PYTHON": sys.executable})
  assert last.startswith("RESULT gpu_check parts=3 ok=3"), last


def test_every_benchmark_takes_smoke_and_out():
  """Without running them: each script's argparse knows --smoke and --out (a new benchmark that
  forgets either fails here in the default suite, not only in the bench tier)."""
  missing = []
  for name in SCRIPTS:
    text = (ROOT / "benchmarks" / f"{name}.py").read_text()
    for flag in ('"--smoke"', '"--out"'):
      if flag not in text:
        missing.append(f"{name}: {flag}")
  assert not missing, missing
