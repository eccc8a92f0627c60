"""The bubblewrap sandbox tool calls run in: a session per episode (session.py), one process per
call with its limits and clocks (call.py), the settings and results (config.py)."""
from posttrain_jax.sandbox.config import (LIMITS, SANDBOX_PATH, ExecResult, SandboxConfig,
                                          SandboxError, SandboxUnavailableError, UnsafePathError)
from posttrain_jax.sandbox.session import Sandbox, SandboxSession

__all__ = ["LIMITS", "SANDBOX_PATH", "ExecResult", "Sandbox", "SandboxConfig", "SandboxError",
           "SandboxSession", "SandboxUnavailableError", "UnsafePathError"]
