"""CI's time box for slow tests (tests/conftest.py): PTJ_SLOW_ROTATE orders whole test files by
the value, the same way every time; PTJ_SLOW_DEADLINE skips a slow test that would start after
it, by name, with a closing count. Each case is a pytest process of its own."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = ["tests/launch"]   # several files, a few seconds to collect


def _pytest(*args, **env) -> str:
  out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0",
                        *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**{k: v for k, v in os.environ.items()
                               if not k.startswith("PTJ_SLOW_")}, **env})
  return out.stdout


def _files(**env) -> list[str]:
  ids = [line for line in _pytest("--collect-only", "-q", "-m", "", *FILES, **env).splitlines()
         if "::" in line]
  return [i.split("::")[0] for i in ids]


def test_rotation_keeps_files_whole_and_orders_them_by_the_value():
  plain, a, a_again, b = _files(), _files(PTJ_SLOW_ROTATE="a"), _files(PTJ_SLOW_ROTATE="a"), \
      _files(PTJ_SLOW_ROTATE="b")
  assert sorted(plain) == sorted(a) == sorted(b) and len(set(plain)) >= 4
  for order in (a, b):   # every file's tests together
    runs = [f for i, f in enumerate(order) if i == 0 or order[i - 1] != f]
    assert len(runs) == len(set(order)), runs
  assert a == a_again and a != b and a != plain


def test_a_slow_test_past_the_deadline_is_reported_not_run():
  out = _pytest("-q", "-m", "slow", "tests/run/test_default_run.py", PTJ_SLOW_DEADLINE="0")
  assert "1 slow test(s) NOT RUN for lack of CI time" in out, out[-2000:]
  assert "test_default_run_improves_heldout_accuracy" in out and "1 skipped" in out
