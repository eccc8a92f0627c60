"""The teacher's prompt shows the tools the student saw: env episodes and rebuilt proxy sessions
record their tools on the trajectory, and the teacher renders its prompt with them."""
import dataclasses

from posttrain_jax import batching
from posttrain_jax.actors.rollout import encode_messages
from posttrain_jax.byoh.rebuild import rebuild_session
from posttrain_jax.byoh.store import StoreConfig, TraceStore
from posttrain_jax.teacher import SelfTeacher, TeacherConfig, teacher_messages
from tests.support import envs as et
from tests.support.byoh import recorded_choice
from tests.support.envs import run_episode, tool_then_answer

TOOLS = [s.to_openai() for s in et.CalcEnv.tools]


def _teacher(tok):
  return SelfTeacher(TeacherConfig(context="feedback", template="{prompt}\n\n{context}"),
                     lambda msgs, tools: encode_messages(tok, msgs, tools),
                     batching.BatchConfig(rows=8, seq_len=512, max_seqs=8))


def test_a_tool_episode_gives_a_teacher_prompt_with_the_tools_block():
  tok, _, _, groups = run_episode("hermes", "hermes", tool_then_answer("hermes"))
  traj = dataclasses.replace(groups[0][0], feedback="use the tool once")
  assert traj.tools == TOOLS                           # recorded by the episode
  student_prompt = tok.decode(traj.token_ids[:traj.prompt_len])
  assert "<tools>" in student_prompt and '"name": "add"' in student_prompt
  owners, seqs, _ = _teacher(tok).sequences([traj])
  assert owners == [0]
  prompt_ids = seqs[0].token_ids[:seqs[0].prompt_len]
  assert seqs[0].token_ids[seqs[0].prompt_len:] == traj.token_ids[traj.prompt_len:]
  msgs = teacher_messages(traj.messages, "Feedback on an earlier attempt: use the tool once",
                          "{prompt}\n\n{context}")
  assert prompt_ids == encode_messages(tok, msgs, TOOLS)
  text = tok.decode(prompt_ids)
  assert "<tools>" in text and '"name": "add"' in text and "use the tool once" in text
  # the same chat without its tools renders no tools block: the tools came from the trajectory
  _, bare, _ = _teacher(tok).sequences([dataclasses.replace(traj, tools=None)])
  assert "<tools>" not in tok.decode(bare[0].token_ids)


def test_a_rebuilt_session_keeps_its_requests_tools(tmp_path):
  store = TraceStore(StoreConfig(path=str(tmp_path / "t.db")))
  try:
    store.begin_call(call_id="a", tenant="t1", session="s", kind="chat", request={"model": "m"},
                     prompt_text="p", prompt_ids=[1, 2],
                     messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    store.end_call("a", status="complete", choices=[recorded_choice(0, [3, 4])], response={"id": "a"},
                   latency_s=0.01)
    trajs, _ = rebuild_session("s", store.calls("t1", "s"))
  finally:
    store.close()
  assert [t.tools for t in trajs] == [TOOLS]
