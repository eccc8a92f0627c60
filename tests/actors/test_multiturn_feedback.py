"""Multi-turn episodes carry the environment's free-text feedback (EnvStep.info["feedback"], or a
ToolEnv grade's GradeResult.info["feedback"]) into every sample, as single-turn rollouts carry
the grader's."""
from posttrain_jax.envs.env import ENVS, EnvStep, register_env
from posttrain_jax.graders import GradeResult
from posttrain_jax.types import Status
from tests.support import envs as et
from tests.support.envs import CALL, run_episode, tool_then_answer


class _Commented(et.CalcEnv):
  """The calculator whose follow-up step and grade both comment on the attempt."""

  async def step(self, turn):
    if not turn.tool_calls and not turn.malformed and self.cfg.follow_up and not self.asked_again:
      self.asked_again = True
      return EnvStep([{"role": "user", "content": "Are you sure?"}],
                     info={"feedback": "the first answer came without a check"})
    return await super().step(turn)

  async def grade(self, turn):
    ok = str(self.cfg.a + self.cfg.b) in turn.content
    text = "right" if ok else f"it is {self.cfg.a + self.cfg.b}"
    return GradeResult(float(ok), {"feedback": text})


def _task(i=0):
  if "test_commented" not in ENVS.names():
    register_env("test_commented", et.CalcConfig)(_Commented)
  return et.calc_task(i, env="test_commented")


def test_the_graders_feedback_reaches_the_episode():
  _, _, _, groups = run_episode("hermes", "hermes", lambda p, k: "It is 7.", tasks=[_task()])
  (t,) = groups[0]
  assert t.status is Status.OK and t.reward == 0.0 and t.feedback == "it is 5"
  _, _, _, groups = run_episode("hermes", "hermes", tool_then_answer("hermes"), tasks=[_task()])
  assert groups[0][0].reward == 1.0 and groups[0][0].feedback == "right"


def test_every_sample_of_a_split_episode_carries_every_step_feedback_in_order():
  """hermes_thinking breaks the prefix after the follow-up: two samples, one episode."""
  def script(prompt, k):
    return ['<think>use add</think>' + CALL["hermes"], "<think>got it</think>It is 5.",
            "Yes, 5."][k]
  _, _, _, groups = run_episode("hermes_thinking", "hermes", script, tasks=[_task()],
                                env_config=dict(follow_up=True))
  first, second = groups[0]
  assert [first.metrics["sample_index"], second.metrics["sample_index"]] == [0, 1]
  want = "the first answer came without a check\nright"
  assert first.feedback == second.feedback == want


def test_an_environment_without_feedback_leaves_it_none():
  _, _, _, groups = run_episode("hermes", "hermes", tool_then_answer("hermes"))
  assert groups[0][0].reward == 1.0 and groups[0][0].feedback is None
