"""The README's test command is the one CI runs."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
  readme = (ROOT / "README.md").read_text()
  blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
  test_cmds = [b for b in blocks if "pytest" in b]
  assert len(test_cmds) == 1, blocks
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  assert test_cmds[0].strip() in [line.strip() for line in ci]


def test_readme_train_command_is_the_default_entry_point():
  readme = (ROOT / "README.md").read_text()
  blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
  assert len(blocks) == 2, blocks
  assert blocks[0].strip() == "pip install -e . && python launch/train.py"
  assert (ROOT / "launch" / "train.py").exists() and (ROOT / "configs" / "default.py").exists()


def test_ci_runs_readme_command_1_in_a_fresh_venv():
  """Stage 0 of .ci/run: README command 1 as written (its own --workdir aside), in a second venv
  made with `python3 -m venv` and nothing installed but the command's own install (no extras)."""
  readme = (ROOT / "README.md").read_text()
  command_1 = re.findall(r"```bash\n(.*?)\n```", readme, re.S)[0].strip()
  install = command_1.split(" && ")[0]
  ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
  runs = [i for i, line in enumerate(ci) if line.startswith(command_1 + " ") or line == command_1]
  assert len(runs) == 1, f"no line of .ci/run starts with {command_1!r}"
  assert ci[runs[0]].startswith(install + " && ")
  before = [line.replace('"', "") for line in ci[:runs[0]] if not line.startswith("#")]
  venvs = [line.split()[-1] for line in before if line.startswith("python3 -m venv ")]
  assert venvs and venvs[-1] != ".venv", venvs
  assert f". {venvs[-1]}/bin/activate" in before, f"{venvs[-1]} is not activated"
  # The test venv comes later: nothing from the `test` extra is installed yet.
  assert not [line for line in before if ".venv" in line or "pip install" in line], before
