"""`model.chat_template` / serve's `config.chat_template`: a checkpoint whose own template drops
`tools` is served and trained under a tool-calling format, and exported with it."""
import pytest
from transformers import AutoTokenizer

from posttrain_jax.byoh.server import detect_tool_format
from posttrain_jax.errors import UserError
from posttrain_jax.models import hf_io
from posttrain_jax.models.chat_templates import CHAT_FORMATS
from posttrain_jax.models.tiny import TinyModelConfig, build_tiny_model

TOOLS = [{"type": "function", "function": {
    "name": "gcd", "description": "The greatest common divisor.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}]
CHAT = [{"role": "user", "content": "gcd of 12 and 18?"}]


@pytest.fixture(scope="module")
def chatml_dir():
  """A model whose own template has no tools (as SmolLM2-135M-Instruct's)."""
  return build_tiny_model(TinyModelConfig(chat_format="chatml"))


def test_the_stored_template_drops_tools(chatml_dir):
  tok = hf_io.load_tokenizer(chatml_dir)
  text = tok.apply_chat_template(CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=True)
  assert '"gcd"' not in text and detect_tool_format(tok) is None


def test_a_named_format_replaces_it_and_names_the_parser(chatml_dir):
  tok = hf_io.load_tokenizer(chatml_dir, "hermes")
  text = tok.apply_chat_template(CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=True)
  assert '"name": "gcd"' in text
  assert "<tools>" in text and text.endswith("<|im_start|>assistant\n")
  assert detect_tool_format(tok) == "hermes"


def test_a_template_file(chatml_dir, tmp_path):
  f = tmp_path / "t.jinja"
  f.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
  tok = hf_io.load_tokenizer(chatml_dir, str(f))
  assert tok.apply_chat_template(CHAT, tokenize=False) == "[user] gcd of 12 and 18?\n"


def test_an_unknown_name_is_one_error_naming_the_field(chatml_dir):
  with pytest.raises(UserError, match=r"model.chat_template='hermes3' is neither a chat format "
                                      r"\(.*hermes.*\) nor a template file"):
    hf_io.load_tokenizer(chatml_dir, "hermes3")
  with pytest.raises(UserError, match=r"^config.chat_template="):
    hf_io.load_tokenizer(chatml_dir, "nope", field="config.chat_template")


def test_the_export_carries_the_template_it_was_given(chatml_dir, tmp_path):
  model = hf_io.load_hf_model(chatml_dir)
  template = CHAT_FORMATS.get("hermes").template
  out = hf_io.save_hf_model(model, tmp_path / "out", tokenizer_dir=chatml_dir,
                            chat_template=template)
  tok = AutoTokenizer.from_pretrained(str(out))   # transformers itself, not our loader
  assert tok.chat_template == template
  plain = hf_io.save_hf_model(model, tmp_path / "plain", tokenizer_dir=chatml_dir)
  assert AutoTokenizer.from_pretrained(str(plain)).chat_template == \
      hf_io.load_tokenizer(chatml_dir).chat_template
