"""The run as a package that knows no names: the loop (loop.py) asks registries, never compares.

    Trainer(cfg).run()          SFT phase, RL phase, held-out eval, checkpoints, resume
    RunState                    the run's own state, saved and restored as one record (state.py)
    rl_step                     one RL step (rl_step.py), the same for the loop and benchmarks
    BatchInputs                 reference / old / teacher log-probs from the loss's needs (inputs.py)
    SOURCES, register_source    rollout sources by rl.mode (sources/)

Imported lazily, so that `posttrain_jax.run_config` can read the source registry (sources/)
without importing the loop.
"""
import importlib

_EXPORTS = {"Trainer": "loop", "result_line": "loop", "RunState": "state", "rl_step": "rl_step",
            "StepResult": "rl_step", "BatchInputs": "inputs", "SOURCES": "sources",
            "register_source": "sources", "SourceContext": "sources"}


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f"posttrain_jax.run.{_EXPORTS[name]}"), name)
  raise AttributeError(f"module 'posttrain_jax.run' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
