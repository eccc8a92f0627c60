"""The config of `launch/serve.py`: which model and engine to serve, the proxy, the store."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from posttrain_jax.byoh.server import ProxyConfig
from posttrain_jax.byoh.store import StoreConfig
from posttrain_jax.config_io import from_dict
from posttrain_jax.engines.registry import engine_spec
from posttrain_jax.models.tiny import TinyModelConfig


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """One proxy: a model behind an engine, recorded into a store."""
  model_path: Optional[str] = None      # a HF model directory; None = the tiny model below
  tiny: TinyModelConfig = TinyModelConfig(chat_format="hermes")  # built locally, with tools
  engine: str = "jax"                   # a registered engine (engines/registry.py)
  engine_config: Optional[Any] = None   # its config (None = its defaults)
  chat_template: Optional[str] = None   # replaces the model's template: a chat format
                                        # (models/chat_templates.py) or a Jinja file
  tool_format: str = "auto"             # tool-call parser (envs/tool_calls.py); "auto" = the
                                        # chat template's ("hermes" / "llama3_json" / none)
  max_prompt_tokens: int = 1024         # the longest prompt the engine is built for
  host: str = "127.0.0.1"
  port: int = 8000
  api_keys_file: Optional[str] = None   # a JSON object {key: tenant}, added to proxy.api_keys
  proxy: ProxyConfig = ProxyConfig()
  store: StoreConfig = StoreConfig()


_DYNAMIC = {(ServeConfig, "engine_config"): lambda v: engine_spec(v["engine"]).config_cls}


def serve_config_from_dict(d: dict) -> ServeConfig:
  """A ServeConfig from nested dicts; errors name the field path."""
  return from_dict(ServeConfig, d, "config", _DYNAMIC)
