"""The wheel installs kernels/, launch/, configs/ inside posttrain_jax, never as top-level names."""
import os
import pathlib
import subprocess
import sys
import zipfile

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
