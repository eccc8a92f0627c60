"""Our decoder == transformers' own PyTorch classes, loaded through our HF loader (fp32)."""
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain_jax.models import hf_io
from tests.support.hf import FAMILIES, VOCAB, hf_logits, save_random_hf_model

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
  path = tmp_path_factory.mktemp(request.param)
  torch_model = save_random_hf_model(request.param, path)
  return torch_model, hf_io.load_hf_model(path)


def _ours(model, ids, positions, segments=None):
  hidden, _ = model(jnp.asarray(ids), jnp.asarray(positions),
                    None if segments is None else jnp.asarray(segments))
  return np.asarray(model.logits(hidden))


def test_random_ids(pair):
  torch_model, ours = pair
  rng = np.random.default_rng(0)
  ids = rng.integers(0, VOCAB, (3, 17))
  pos = np.broadcast_to(np.arange(17), ids.shape)
  diff = np.abs(_ours(ours, ids, pos) - hf_logits(torch_model, ids)).max()
  assert diff <= TOL, diff


def test_padded(pair):
  """Right and left padding: segment 0 is never attended; real tokens match HF's masked run."""
  torch_model, ours = pair
  rng = np.random.default_rng(1)
  ids = rng.integers(0, VOCAB, (2, 12))
  lens = [12, 7]
  for side in ("right", "left"):
    valid = np.zeros_like(ids)
    for b, n in enumerate(lens):
      if side == "right":
        valid[b, :n] = 1
      else:
        valid[b, 12 - n:] = 1
    pos = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
    ref = hf_logits(torch_model, ids, attention_mask=valid, position_ids=pos)
    got = _ours(ours, ids, pos, valid)
    m = valid.astype(bool)
    assert np.abs(got[m] - ref[m]).max() <= TOL, side


def test_packed(pair):
  """Two sequences packed in one row == each run alone."""
  torch_model, ours = pair
  rng = np.random.default_rng(2)
  a, b = rng.integers(0, VOCAB, 9), rng.integers(0, VOCAB, 6)
  ids = np.concatenate([a, b, [0, 0]])[None]
  seg = np.array([[1] * 9 + [2] * 6 + [0, 0]])
  pos = np.array([list(range(9)) + list(range(6)) + [0, 0]])
  got = _ours(ours, ids, pos, seg)[0]
  ref_a = hf_logits(torch_model, a[None])[0]
  ref_b = hf_logits(torch_model, b[None])[0]
  assert np.abs(got[:9] - ref_a).max() <= TOL
  assert np.abs(got[9:15] - ref_b).max() <= TOL
