"""Imports flow one way (STYLE.md): types -> losses/envs -> models -> learner -> actors -> launch."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Rank of each top-level part; a module may import parts of its own rank or lower only.
RANKS = {
    "registry": 0, "types": 0, "config_io": 0, "errors": 0,
    "kernels": 1, "sharding": 1, "multihost": 1, "tenants": 1,
    "losses": 2, "envs": 2, "tasks": 2, "graders": 2, "sandbox": 2, "advantages": 2, "batching": 2, "overlap": 2, "metrics": 2, "checkpoint": 2,
    "step_metrics": 2,
    "audit": 2,
    "models": 3,
    "learner": 4, "engines": 4,
    "actors": 5, "replay": 5, "byoh": 5, "teacher": 5, "teacher_weights": 5,
    "run_config": 6, "run": 6, "aot": 6,
    "launch": 7, "configs": 7,
}


def _part(path: pathlib.Path) -> str:
  rel = path.relative_to(ROOT)
  if rel.parts[0] in ("kernels", "launch", "configs"):
    return rel.parts[0]
  name = rel.parts[1]
  return name[:-3] if name.endswith(".py") else name


def _imported_parts(tree: ast.AST) -> set[str]:
  out = set()
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    for n in names:
      parts = n.split(".")
      if parts[0] == "posttrain_jax" and len(parts) > 1 and parts[1] in RANKS:
        out.add(parts[1])
  return out


def test_imports_flow_one_way():
  files = [p for p in (ROOT / "posttrain_jax").rglob("*.py")]
  files += [p for d in ("kernels", "launch", "configs") for p in (ROOT / d).rglob("*.py")]
  violations = []
  for path in files:
    if path.name == "__init__.py" and path.parent == ROOT / "posttrain_jax":
      continue
    part = _part(path)
    assert part in RANKS, f"{path}: give the new part {part!r} a rank in tests/test_layering.py"
    for dep in _imported_parts(ast.parse(path.read_text())):
      if RANKS[dep] > RANKS[part]:
        violations.append(f"{path.relative_to(ROOT)} ({part}) imports {dep}")
  assert not violations, "\n".join(violations)


def test_kernels_import_only_jax():
  for path in (ROOT / "kernels").rglob("*.py"):
    deps = _imported_parts(ast.parse(path.read_text())) - {"kernels"}
    assert not deps, f"{path}: kernels import nothing of the project, found {deps}"
