"""The run knows no names (ARCHITECTURE.md, "Registries"): no code compares an engine, rollout
mode, episode type, teacher or loss name with a string; it asks the registry entry instead. A
registry entry may compare its own name (an entry's module, e.g. run/sources/auto.py turning
"async"); everything else that does is listed here as a violation."""
import ast
import pathlib

from posttrain_jax.actors.episode import EPISODES
from posttrain_jax.engines.registry import ENGINES
from posttrain_jax.losses.base import LOSSES
from posttrain_jax.run.sources import SOURCES
from posttrain_jax.teacher_weights import TEACHER_WEIGHTS

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the config field each registry is chosen by -> (the registry, the modules of its entries)
FIELDS = {"engine": ENGINES, "mode": SOURCES, "episode": EPISODES, "weights": TEACHER_WEIGHTS,
          "loss": LOSSES}


def _entry_module(obj) -> str:
  fn = getattr(obj, "build", None) or getattr(obj, "fn", None) or obj
  return fn.__module__


def _owners() -> dict[str, set[str]]:
  """field -> modules registering an entry of that field's registry (they may compare)."""
  out = {}
  for field, registry in FIELDS.items():
    out[field] = {_entry_module(registry.get(n)) for n in registry.names()}
  return out


def _field(node) -> str:
  if isinstance(node, ast.Attribute):
    return node.attr
  if isinstance(node, ast.Name):
    return node.id
  return ""


def _strings(node) -> list[str]:
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    return [node.value]
  if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    return [s for e in node.elts for s in _strings(e)]
  return []


def violations(paths, owners) -> list[str]:
  out = []
  for path in paths:
    rel = path.relative_to(ROOT)
    module = ".".join(("posttrain_jax", *rel.with_suffix("").parts)
                      if rel.parts[0] != "posttrain_jax" else rel.with_suffix("").parts)
    for node in ast.walk(ast.parse(path.read_text())):
      if not isinstance(node, ast.Compare):
        continue
      sides = [node.left, *node.comparators]
      for i, side in enumerate(sides):
        field = _field(side)
        if field not in FIELDS or module in owners[field]:
          continue
        names = set(FIELDS[field].names())
        for other in sides[:i] + sides[i + 1:]:
          hit = names & set(_strings(other))
          if hit:
            out.append(f"{rel}:{node.lineno} compares {field} with {sorted(hit)}")
  return out


def test_nothing_outside_a_registry_entry_compares_a_name():
  paths = sorted((ROOT / "posttrain_jax").rglob("*.py")) + sorted((ROOT / "launch").rglob("*.py"))
  found = violations(paths, _owners())
  assert not found, "\n".join(found)


def test_the_check_can_fail(tmp_path):
  """The pattern the trainer used to have is caught."""
  bad = ROOT / "posttrain_jax" / "_probe_for_the_name_check.py"
  bad.write_text('def f(cfg):\n  return cfg.rl.engine == "fleet" or cfg.rl.mode in ("traces",)\n')
  try:
    found = violations([bad], _owners())
  finally:
    bad.unlink()
  assert len(found) == 2 and "engine" in found[0] and "mode" in found[1], found
