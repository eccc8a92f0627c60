"""An LLM judge as the grader: relative scores for GRPO, critiques for self-distillation.

    python launch/serve.py ...                          # or any vLLM / OpenAI-compatible server
    python launch/train.py --config=configs/judge.py \
        --config.grader_config.base_url=http://127.0.0.1:8000/v1 \
        --config.grader_config.model=Qwen/Qwen3-8B

configs/distill_mix.py's run (the tiny model, SFT warm-start, 16 prompts x 8 samples) graded by
the "judge" grader (posttrain_jax/graders/judge.py): the judge sees the 8 answers to a prompt in
one call and scores them against each other (RULER); the scores are the rewards of GRPO's group
advantage, and each answer's critique is its feedback, which the teacher (the model itself, an
EMA of its weights) reads in its prompt (`rl.teacher.context=feedback`); sampled_distill mixes
the two (coef·(log T − log π) + rl_coef·Â per sampled token). Verdicts are cached in
`<workdir>/judge.sqlite`, so a resumed run never asks for a pair again. A judge that fails is an
infra error (the task is retried, counted), never a reward of 0. The key, if the endpoint needs
one, comes from an environment variable: `--config.grader_config.api_key_env=OPENAI_API_KEY`.
"""
from posttrain_jax.configs.distill_mix import get_config as distill_mix_config

RUBRIC = ("The task is an arithmetic question with a reference answer. An answer whose final "
          "number equals the reference scores 10; a wrong number scores by how close the working "
          "comes to a correct method (0-5); no number, or several conflicting ones, scores 0.")


def get_config():
  c = distill_mix_config()
  c.workdir = "runs/judge"
  c.grader = "judge"
  c.grader_config = dict(base_url="http://127.0.0.1:8000/v1", model="posttrain_jax",
                         api_key_env=None, rubric=RUBRIC, group=True, min_score=0.0,
                         max_score=10.0, temperature=0.0, max_tokens=1024, timeout_s=60.0,
                         retries=2, cache_path=f"{c.workdir}/judge.sqlite")
  c.rl.teacher.context = "feedback"
  return c
