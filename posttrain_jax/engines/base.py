"""The rollout-engine protocol: generate with token ids + log-probs, update weights, version.

Every engine (embedded JAX sampler, vLLM in-process, an OpenAI-compatible server) returns
the token ids it actually sampled and the log-prob of each under the distribution it sampled
from, tagged with the weights version that produced them. Training uses exactly these ids.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol, Sequence


class EngineError(RuntimeError):
  """Our side failed (engine crash, unreachable server): an infra error, never a reward of 0."""


class PromptTooLongError(ValueError):
  """Prompt `index` of a request can never be served (longer than the engine accepts, or too
  long for the model's context with the max_tokens asked): not an infra error and not worth a
  retry; the rollout source drops the task, counted as "invalid". `param`: the request field
  to change ("messages": the prompt; "max_tokens"), which the proxy's 400 names."""

  def __init__(self, index: int, message: str, param: str = "messages"):
    super().__init__(message)
    self.index, self.param = index, param


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to sample; hashable so jitted samplers can specialise on it."""
  max_tokens: int = 64            # new tokens per completion
  temperature: float = 1.0        # 0 = greedy
  top_p: float = 1.0              # nucleus mass kept (1 = off)
  top_k: int = 0                  # keep the k most likely tokens (0 = off)
  stop_token_ids: tuple[int, ...] = ()  # sampling a stop token ends the completion (it is kept)
  top_logprobs: int = 0           # also return the k most likely tokens at each sampled position
                                  # (engines whose `max_top_logprobs` >= k; Completion.top_logprobs)
  response_format: Optional[str] = None  # JSON text of an OpenAI response_format the output must
                                  # follow ({"type": "json_object"} | {"type": "json_schema",
                                  # "json_schema": {"schema": ...}}): engines with `guided_decoding`


@dataclasses.dataclass
class Completion:
  """One sampled continuation of a prompt."""
  token_ids: list[int]            # sampled ids, a final stop token included
  logprobs: list[float]           # log-prob of each sampled id (see the engine for which distribution)
  finish_reason: str              # "stop" (stop token) | "length" (max_tokens reached) |
                                  # "abort" (cut in flight, e.g. by a weight update) | "error"
  version: int                    # policy version of the weights that sampled it
  top_logprobs: Optional[list[list[tuple[int, float]]]] = None  # per sampled token, the
                                  # SamplingParams.top_logprobs most likely (id, log-prob) pairs,
                                  # most likely first, under the distribution `logprobs` uses


class Engine(Protocol):
  """What actors need from a rollout engine."""

  @property
  def version(self) -> int: ...

  def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, n: int = 1,
               seed: Optional[int] = None) -> list[list[Completion]]:
    """`n` completions per prompt (token-id prompts), in prompt order."""
    ...

  def update_weights(self, weights: Any, version: int) -> None:
    """Installs new weights; later generations report `version`."""
    ...

  # Optional: `stream(prompt, sampling, n, seed, cancelled=Event) -> Iterator[list[Completion]]`,
  # the n completions of one prompt as they grow, the last item final and equal to what
  # `generate` returns (JaxSampler). The proxy streams text while it is sampled with it.
  #
  # Optional capabilities, class attributes read with `capability(engine, name)` (absent: the
  # engine cannot, and the proxy refuses a request that needs it rather than ignore it):
  #   max_top_logprobs: int    the most alternatives per sampled token it returns
  #                            (SamplingParams.top_logprobs)
  #   guided_decoding: bool    it constrains decoding to SamplingParams.response_format
  #   context_len: int         the most prompt + max_tokens it serves (the model's context;
  #                            an instance attribute); 0 = unknown


CAPABILITIES = {"max_top_logprobs": 0, "guided_decoding": False, "context_len": 0}


def capability(engine: Any, name: str):
  """What `engine` declares for capability `name` (CAPABILITIES: the names and the value of an
  engine that declares nothing). Wrappers that forward attributes (DecoderWeights) pass it on."""
  return getattr(engine, name, CAPABILITIES[name])


def engine_metrics(engine: Any) -> dict[str, float]:
  """The engine's own per-step metrics if it reports any (an optional `metrics()`, e.g. a
  fleet's servers in service), else {}; both rollout sources log them."""
  report = getattr(engine, "metrics", None)
  return report() if callable(report) else {}
