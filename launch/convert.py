"""Convert a GGUF model file into a HF model directory:
`python launch/convert.py --gguf FILE.gguf --out DIR`.

DIR gets config.json, model.safetensors (float32, dequantised), the tokenizer with its chat
template and generation_config.json (posttrain_jax/models/gguf_io.py); transformers and vLLM
load it as any HF checkpoint. Training needs no conversion step: `--config.model.path` takes
the .gguf file itself and converts it once into a cache. A mistake (no such file, a
quantisation or architecture we cannot read) is one `error: ...` line and exit status 1.
"""
import sys

from absl import app, flags

from posttrain_jax.errors import UserError

_GGUF = flags.DEFINE_string("gguf", None, "The .gguf file to convert.", required=True)
_OUT = flags.DEFINE_string("out", None, "The HF directory to write (replaced if it exists).",
                           required=True)


def main(argv):
  del argv
  from posttrain_jax.models import gguf_io
  try:
    out = gguf_io.gguf_to_hf(_GGUF.value, _OUT.value)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
