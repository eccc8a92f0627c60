"""Serve the tiny hermes-format model with the embedded sampler, recording into runs/traces.db.

`python launch/serve.py` then point any OpenAI client at http://127.0.0.1:8000/v1 (model
"posttrain_jax"). Serve your own checkpoint with `--config.model_path=DIR`, vLLM with
`--config.engine=vllm`, require keys with `--config.api_keys_file=keys.json` ({key: tenant}).
"""
from ml_collections import config_dict

from posttrain_jax.byoh.serve_config import ServeConfig
from posttrain_jax.config_io import to_dict


def get_config():
  c = config_dict.ConfigDict(to_dict(ServeConfig()))
  c.engine_config = config_dict.placeholder(dict)
  c.model_path = config_dict.placeholder(str)
  c.api_keys_file = config_dict.placeholder(str)
  return c
