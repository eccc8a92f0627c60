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
