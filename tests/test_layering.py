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


_ROOTS = {"kernels": ROOT / "kernels", "launch": ROOT / "launch", "configs": ROOT / "configs"}


def _module_file(module: str) -> pathlib.Path | None:
  parts = module.split(".")
  if len(parts) > 1 and parts[1] in _ROOTS:  # setup.py maps these top-level folders into the package
    base = _ROOTS[parts[1]].joinpath(*parts[2:])
  else:
    base = ROOT.joinpath(*parts)
  for p in (base.with_suffix(".py"), base / "__init__.py"):
    if p.exists():
      return p
  return None


def _top_level_names(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names.update((a.asname or a.name).split(".")[0] for a in node.names)
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
      names.add(node.id)
    elif isinstance(node, ast.Dict):  # a lazy package's export table: {"Trainer": "loop", ...}
      names.update(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
  return names


def test_every_from_import_of_ours_names_something_that_exists():
  """A rename inside the package must not leave a benchmark or example importing the old name
  (a benchmark imports lazily, so nothing else notices until its smoke run)."""
  files = [p for p in ROOT.rglob("*.py") if ".venv" not in p.parts and "build" not in p.parts]
  missing = []
  for path in files:
    for node in ast.walk(ast.parse(path.read_text())):
      if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
              and node.module.split(".")[0] == "posttrain_jax"):
        continue
      target = _module_file(node.module)
      if target is None:
        missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: no module {node.module}")
        continue
      defined = _top_level_names(target)
      for a in node.names:
        if a.name == "*" or a.name in defined or _module_file(f"{node.module}.{a.name}"):
          continue
        missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module} has no {a.name}")
  assert not missing, "\n".join(missing)
