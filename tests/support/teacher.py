"""Shared test helpers (teacher), moved out of the test modules that used to import each other."""
import numpy as np
import torch
from tests.support.hf import VOCAB
from posttrain_jax.types import Trajectory


def encode(messages, tools=None):
  """A stand-in chat template: every character of "role: content" lines to an id (the tools'
  names first, as a "tools:" line)."""
  text = f"tools: {' '.join(t['function']['name'] for t in tools)}\n" if tools else ""
  text += "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
  return [ord(c) % (VOCAB - 1) + 1 for c in text]


def make_traj(i, prompt, feedback, rng, tail=True):
  """Prompt ids, a sampled answer, then (tail) a masked tool result and a second sampled span."""
  msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]
  p = encode(msgs)
  spans = [(rng.integers(1, VOCAB, 5).tolist(), 1)]
  if tail:
    spans += [(rng.integers(1, VOCAB, 3).tolist(), 0), (rng.integers(1, VOCAB, 4).tolist(), 1)]
  ids, mask = list(p), [0] * len(p)
  for toks, m in spans:
    ids += toks
    mask += [m] * len(toks)
  return Trajectory(id=f"t{i}", task_id=f"task{i}", group_id=f"g{i}", token_ids=ids,
                    loss_mask=mask, behaviour_logprobs=[-1.0 * m for m in mask],
                    policy_version=[0 if m else -1 for m in mask],
                    messages=[*msgs, {"role": "assistant", "content": "x"}], reward=0.0,
                    feedback=feedback)


def hf_token_logprobs(torch_model, ids):
  with torch.no_grad():
    logits = torch_model(torch.tensor([ids])).logits[0].double()
  logp = torch.log_softmax(logits, -1).numpy()
  return np.array([logp[t - 1, ids[t]] for t in range(1, len(ids))])   # position t predicts ids[t]

