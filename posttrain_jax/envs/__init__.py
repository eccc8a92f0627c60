"""Multi-turn environments with tools (level 2 of ARCHITECTURE.md).

An environment is a `ToolEnv` subclass registered with `@register_env(name, ConfigClass,
demonstration=...)` (env.py); its tasks come from a generator it registers beside it
(posttrain_jax/tasks/), its tool calls run in the sandbox (posttrain_jax/sandbox/). Every module
of this package is imported on the first registry lookup: a new environment is one file here
plus its test.
"""
from posttrain_jax.envs.env import (ENVS, Budgets, EnvInfraError, Environment, EnvStep, ToolEnv,
                                    ToolEnvConfig, ToolFailure, ToolSpec, env_spec, register_env)

__all__ = ["ENVS", "Budgets", "EnvInfraError", "EnvStep", "Environment", "ToolEnv",
           "ToolEnvConfig", "ToolFailure", "ToolSpec", "env_spec", "register_env"]
