"""Serve the tiny hermes-format model with the embedded sampler, recording into runs/traces.db.

`python launch/serve.py` then point any OpenAI client at http://127.0.0.1:8000/v1 (model
"posttrain_jax"). Serve your own checkpoint with `--config.model_path=DIR`, require keys with
`--config.api_keys_file=keys.json` ({key: tenant}). Another engine: `--config=configs/serve.py:vllm`
(any registered engine's name after the colon) selects it and makes each of its settings a flag,
e.g. `--config.engine_config.dtype=float32 --config.engine_config.max_model_len=1024`;
`--config.engine=vllm` alone serves it with its defaults.
"""
from ml_collections import config_dict

from posttrain_jax.byoh.serve_config import ServeConfig
from posttrain_jax.config_io import config_dict_of, to_dict


def get_config(engine: str = ""):
  c = config_dict.ConfigDict(to_dict(ServeConfig()))
  if engine:
    from posttrain_jax.engines.registry import engine_spec
    c.engine = engine
    c.engine_config = config_dict_of(engine_spec(engine).config_cls())
  else:
    c.engine_config = config_dict.placeholder(dict)
  c.model_path = config_dict.placeholder(str)
  c.api_keys_file = config_dict.placeholder(str)
  return c
