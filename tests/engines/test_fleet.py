"""The fleet's errors without any server: each names the field or every URL it tried."""
import pytest

from posttrain_jax.config_io import ConfigTypeError
from posttrain_jax.engines.base import EngineError
from posttrain_jax.engines.fleet import FleetConfig, FleetEngine
from posttrain_jax.engines.openai_engine import OpenAIEngineConfig, ServerUnreachable
from posttrain_jax.engines.registry import engine_spec
from posttrain_jax.engines.vllm_server import free_port


def test_no_urls_and_a_url_twice_are_refused():
  with pytest.raises(EngineError, match="FleetConfig.urls is empty"):
    FleetEngine(FleetConfig())
  with pytest.raises(EngineError, match="lists a server twice"):
    FleetEngine(FleetConfig(urls=("http://127.0.0.1:1", "http://127.0.0.1:1")))


def test_no_server_answering_names_every_url():
  urls = tuple(f"http://127.0.0.1:{free_port()}" for _ in range(2))
  cfg = FleetConfig(urls=urls, health_interval_s=0,
                    server=OpenAIEngineConfig(connect_timeout_s=0.5, max_retries=0))
  with pytest.raises(ServerUnreachable) as e:
    FleetEngine(cfg)
  assert "no server of the fleet answers" in str(e.value)
  assert all(u in str(e.value) for u in urls)


def test_the_run_config_check_names_the_field():
  spec = engine_spec("fleet")
  with pytest.raises(ConfigTypeError, match=r"rl.engine_config.urls"):
    spec.check(FleetConfig(), None, 8)
  with pytest.raises(ConfigTypeError, match=r"rl.engine_config.server.weights_dir"):
    spec.check(FleetConfig(urls=("http://127.0.0.1:8000",)), None, 8)
  spec.check(FleetConfig(urls=("http://127.0.0.1:8000",),
                         server=OpenAIEngineConfig(weights_dir="/tmp/w")), None, 8)


def test_behind_the_proxy_the_server_engines_need_no_weights_dir_and_name_serve_fields():
  """launch/serve.py only serves: a remote server or a fleet syncs no weights there, and an
  error names serve.py's own field (config.engine_config), not the training run's."""
  for name, cfg in [("openai", OpenAIEngineConfig()),
                    ("fleet", FleetConfig(urls=("http://127.0.0.1:8000",)))]:
    with pytest.raises(ConfigTypeError, match="weights_dir"):
      engine_spec(name).check(cfg, None, 8)
    engine_spec(name).check(cfg, None, 8, field="config.engine_config", serving=True)
  with pytest.raises(ConfigTypeError, match=r"^config\.engine_config\.urls"):
    engine_spec("fleet").check(FleetConfig(), None, 8, field="config.engine_config",
                               serving=True)
