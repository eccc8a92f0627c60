"""Serve: `python launch/serve.py [--config=configs/serve.py] [--config.<field>=value ...]`.

An OpenAI-compatible endpoint (posttrain_jax/byoh/) in front of the configured engine, recording
every call token-exactly into the trace store. With no flags: the tiny hermes-format model
(built locally) on the embedded sampler at http://127.0.0.1:8000/v1, model "posttrain_jax",
traces in runs/traces.db. Prints one `serving ...` line when it accepts calls; SIGINT / SIGTERM
stop it (calls in flight are recorded as incomplete).
"""
import json
import pathlib
import sys

from absl import app, flags

from posttrain_jax.errors import UserError
from posttrain_jax.launch.cli import flags_parser

_DEFAULT = pathlib.Path(__file__).resolve().parent.parent / "configs" / "serve.py"


def build_proxy(cfg):
  """The Proxy of a ServeConfig: model, tokenizer, engine (as the trainer builds it), store."""
  from posttrain_jax.byoh.server import Proxy, detect_tool_format
  from posttrain_jax.byoh.store import TraceStore
  from posttrain_jax.engines.registry import EngineContext, engine_spec
  from posttrain_jax.models import hf_io
  from posttrain_jax.models.tiny import build_tiny_model
  from flax import nnx

  model_dir = pathlib.Path(cfg.model_path) if cfg.model_path else build_tiny_model(cfg.tiny)
  tokenizer = hf_io.load_tokenizer(model_dir, cfg.chat_template, field="config.chat_template")
  model_cfg = hf_io.read_model_config(model_dir)
  eos = model_cfg.eos_token_id
  stops = tuple(eos) if isinstance(eos, tuple) else ((eos,) if eos is not None else ())
  if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
    stops = (tokenizer.eos_token_id,) + stops
  spec = engine_spec(cfg.engine)
  engine_cfg = cfg.engine_config if cfg.engine_config is not None else spec.config_cls()
  if spec.check is not None:
    spec.check(engine_cfg, model_cfg, cfg.proxy.max_tokens_limit, field="config.engine_config",
               serving=True)
  model = hf_io.load_hf_model(model_dir)
  graphdef, _ = nnx.split(model, nnx.Param)
  ctx = EngineContext(model_dir=model_dir, model_config=model_cfg, model=model,
                      graphdef=graphdef, max_prompt_len=cfg.max_prompt_tokens,
                      max_tokens=cfg.proxy.max_tokens_limit,
                      pad_id=tokenizer.pad_token_id or 0)
  engine = spec.build(engine_cfg, ctx)
  proxy_cfg = cfg.proxy
  if cfg.api_keys_file:
    try:
      keys = json.loads(pathlib.Path(cfg.api_keys_file).read_text())
    except (OSError, json.JSONDecodeError) as e:
      raise UserError(f"config.api_keys_file={cfg.api_keys_file}: {e}") from None
    if not isinstance(keys, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in keys.items()):
      raise UserError(f"config.api_keys_file={cfg.api_keys_file}: must be a JSON object "
                      "{key: tenant}")
    import dataclasses
    proxy_cfg = dataclasses.replace(proxy_cfg, api_keys=proxy_cfg.api_keys + tuple(keys.items()))
  tool_format = {"auto": detect_tool_format(tokenizer), "none": None}.get(cfg.tool_format,
                                                                          cfg.tool_format)
  return Proxy(proxy_cfg, engine, tokenizer, TraceStore(cfg.store), stops, tool_format)


def main(argv):
  if len(argv) > 1:
    raise UserError(f"unexpected argument(s) {argv[1:]}; flags look like --config.port=8001")
  from posttrain_jax.byoh.app import serve
  from posttrain_jax.byoh.serve_config import serve_config_from_dict
  from posttrain_jax.byoh.store import StoreError
  from posttrain_jax.config_io import ConfigTypeError

  try:
    cfg = serve_config_from_dict(flags.FLAGS.config.to_dict())
    proxy = build_proxy(cfg)
  except (ConfigTypeError, StoreError) as e:
    raise UserError(str(e)) from None
  def ready():
    print(f"serving {cfg.proxy.model_name} at http://{cfg.host}:{cfg.port}/v1 "
          f"(engine {cfg.engine}, traces in {cfg.store.path})", flush=True)
  def close_engine():   # this process built it: vLLM's engine core and workers end with it
    if hasattr(proxy.engine, "close"):
      proxy.engine.close()
  try:
    serve(proxy, cfg.host, cfg.port, on_ready=ready, on_shutdown=close_engine)
  finally:   # a stop that is not a signal (uvicorn re-raises SIGTERM / SIGINT after shutdown)
    close_engine()


if __name__ == "__main__":
  try:
    app.run(main, flags_parser=flags_parser(str(_DEFAULT)))
  except UserError as e:
    sys.exit(f"error: {e}")
