"""The "judge" grader against real HTTP servers started here: a deterministic judge written in
this file (http.server in a thread: it reads the rubric's key word, the reference and the answers
from the request and scores by a fixed rule, which the tests recompute independently), and our
own proxy (byoh/app.py, as launch/serve.py serves it) on the tiny random model, whose replies
are garbage. Checked: the request (rubric, all G answers in one call, json mode), parsing,
normalisation to [0, 1], critique -> feedback, the cache (no second request for a pair, across
processes via SQLite), and that every failure is a JudgeError naming the endpoint -- an
infra_error in a rollout, never a reward of 0."""
import http.server
import json
import re
import socket
import threading
import time

import pytest

from posttrain_jax.actors.rollout import RolloutConfig, TaskEpisode
from posttrain_jax.actors.episode import WorkItem
from posttrain_jax.config_io import ConfigTypeError
from posttrain_jax.graders import (GradeResult, GraderError, JudgeConfig, JudgeConfigError,
                                   JudgeError, grade_group, grader_metrics, make_grader)
from posttrain_jax.graders.judge import _BadReply, parse_verdicts
from posttrain_jax.run_config import run_config_from_dict
from posttrain_jax.tasks.task import Task
from posttrain_jax.types import Status

RUBRIC = "An answer that names the reference is decent; one that also says PINEAPPLE is perfect."
TASK = Task(id="fruit:1", prompt="Name a yellow fruit.", answer="banana")
ANSWERS = ["banana PINEAPPLE", "a banana", "an apple", "PINEAPPLE!"]


def rule(answer: str, keyword: str = "PINEAPPLE", reference: str = "banana") -> float:
  """The fake judge's rubric, written again here: 10 / 6 / 1."""
  return 10.0 if keyword in answer else 6.0 if reference in answer else 1.0


def critique(answer: str) -> str:
  return f"{len(answer)} chars; " + ("fine" if "PINEAPPLE" in answer else "say PINEAPPLE")


# -- a deterministic judge over HTTP ------------------------------------------------------------

class _Handler(http.server.BaseHTTPRequestHandler):
  def log_message(self, *a):
    pass

  def _send(self, status: int, payload) -> None:
    data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def do_GET(self):
    srv = self.server
    srv.gets.append(self.path)
    self._send(200, {"object": "list", "data": [{"id": m} for m in srv.models]})

  def do_POST(self):
    srv = self.server
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    srv.requests.append({"path": self.path, "body": body,
                         "auth": self.headers.get("Authorization")})
    mode = srv.mode
    if mode == "slow":
      time.sleep(1.0)
    if mode == "http500":
      return self._send(500, {"error": {"message": "judge overloaded"}})
    if mode == "http401":
      return self._send(401, {"error": {"message": "bad key"}})
    if mode == "no_json_mode" and "response_format" in body:   # as our proxy answers
      return self._send(400, {"error": {"message": "response_format is not supported",
                                        "param": "response_format",
                                        "code": "unsupported_parameter"}})
    if mode == "not_completion":
      return self._send(200, {"hello": "world"})
    system, user = (m["content"] for m in body["messages"])
    keyword = re.search(r"<rubric>.*?\b([A-Z]{4,})\b.*?</rubric>", system, re.S).group(1)
    ref = re.search(r"<reference>\n(.*?)\n</reference>", user, re.S)
    answers = re.findall(r'<answer id="\d+">\n(.*?)\n</answer>', user, re.S)
    scores = [rule(a, keyword, ref.group(1) if ref else "\0") for a in answers]
    crits = [critique(a) for a in answers]
    if mode == "out_of_range":
      scores = [11.0] * len(scores)
    if mode == "wrong_count":
      scores = scores[:-1]
    payload = ({"score": scores[0], "critique": crits[0]} if len(answers) == 1
               else {"scores": scores, "critiques": crits})
    content = json.dumps(payload)
    if mode == "prose":     # a thinking block with a bad object, a note object, code fences
      content = ('<think>maybe {"score": 99}</think>Notes: {"note": 1}\nVerdict:\n```json\n'
                 f"{content}\n```\nHope this helps.")
    elif mode == "garbage":
      content = "They all look fine to me."
    elif mode == "long_garbage":
      content = "z" * 5000
    self._send(200, {"id": "c1", "object": "chat.completion", "model": body["model"],
                     "choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": content}}]})


@pytest.fixture(scope="module")
def server():
  srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
  srv.daemon_threads = True
  srv.models = ["fake-judge"]
  thread = threading.Thread(target=srv.serve_forever, daemon=True)
  thread.start()
  yield srv
  srv.shutdown()
  srv.server_close()


@pytest.fixture()
def fake(server):
  server.mode, server.requests, server.gets = "ok", [], []
  return server


def _cfg(srv, **kw) -> JudgeConfig:
  base = dict(base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", model="fake-judge",
              rubric=RUBRIC, retries=2, backoff_s=0.0, timeout_s=5.0)
  return JudgeConfig(**{**base, **kw})


def _dead_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# -- (a) the request, parsing, normalisation, feedback, cache ---------------------------------

def test_group_is_one_call_with_the_rubric_and_every_answer(fake):
  judge = make_grader("judge", _cfg(fake))
  assert fake.gets == ["/v1/models"]                       # the probe, once
  results = grade_group(judge, ANSWERS, TASK)
  (req,) = fake.requests                                   # G answers, one request
  body = req["body"]
  assert req["path"] == "/v1/chat/completions" and body["model"] == "fake-judge"
  assert body["response_format"] == {"type": "json_object"}
  assert (body["temperature"], body["max_tokens"]) == (0.0, 1024)
  system, user = body["messages"][0]["content"], body["messages"][1]["content"]
  assert RUBRIC in system and '"scores"' in system and "4 answers" in system
  assert TASK.prompt in user and "<reference>\nbanana\n</reference>" in user
  assert re.findall(r'<answer id="(\d+)">\n(.*?)\n</answer>', user, re.S) == [
      (str(i + 1), a) for i, a in enumerate(ANSWERS)]
  assert [r.reward for r in results] == [rule(a) / 10 for a in ANSWERS] == [1.0, 0.6, 0.1, 1.0]
  assert [r.info["feedback"] for r in results] == [critique(a) for a in ANSWERS]
  assert all(r.parse_ok and r.info["judge_relative"] for r in results)
  m = grader_metrics(judge)
  assert (m["judge/requests"], m["judge/verdicts"], m["judge/cache_hits"]) == (1.0, 4.0, 0.0)


def test_scores_map_linearly_onto_0_1_and_one_answer_is_asked_alone(fake):
  judge = make_grader("judge", _cfg(fake, min_score=1.0, max_score=11.0, group=False,
                                    show_reference=False))
  results = judge.grade_group(ANSWERS, TASK)
  assert len(fake.requests) == 4                           # group=False: one call per answer
  for req in fake.requests:
    system, user = (m["content"] for m in req["body"]["messages"])
    assert '"score"' in system and '"scores"' not in system and "<reference>" not in user
    assert len(re.findall(r"<answer id=", user)) == 1
  # no reference shown: the fake's rule gives 10 for PINEAPPLE, else 1 -> (s - 1) / 10
  want = [(10.0 - 1) / 10 if "PINEAPPLE" in a else 0.0 for a in ANSWERS]
  assert [r.reward for r in results] == pytest.approx(want)
  assert not any(r.info["judge_relative"] for r in results)
  assert judge(ANSWERS[1], TASK).reward == 0.0 and len(fake.requests) == 4   # cached


def test_a_pair_is_never_asked_twice(fake, tmp_path):
  path = str(tmp_path / "verdicts.sqlite")
  judge = make_grader("judge", _cfg(fake, cache_path=path))
  first = judge.grade_group(ANSWERS, TASK)
  again = judge.grade_group(ANSWERS, TASK)
  assert len(fake.requests) == 1
  assert [r.reward for r in again] == [r.reward for r in first]
  assert all(r.info["judge_cached"] for r in again)
  # a group with two judged answers, one new answer twice: one call with the new one only
  mixed = judge.grade_group([ANSWERS[0], "a PINEAPPLE", ANSWERS[2], "a PINEAPPLE"], TASK)
  assert len(fake.requests) == 2
  user = fake.requests[-1]["body"]["messages"][1]["content"]
  assert re.findall(r'<answer id="\d+">\n(.*?)\n</answer>', user) == ["a PINEAPPLE"]
  assert [r.reward for r in mixed] == [1.0, 1.0, 0.1, 1.0]
  assert [r.info["judge_cached"] for r in mixed] == [True, False, True, False]
  m = judge.metrics()
  assert (m["judge/requests"], m["judge/cache_hits"], m["judge/verdicts"]) == (2.0, 6.0, 5.0)
  # another task with the same answer text is another pair
  judge.grade_group(["a banana"], Task(id="fruit:2", prompt="Name a long fruit.", answer="banana"))
  assert len(fake.requests) == 3
  # a new process (a new judge on the same file, nothing in memory) asks nothing
  judge.close()
  reborn = make_grader("judge", _cfg(fake, cache_path=path, cache_size=0))
  assert [r.reward for r in reborn.grade_group(ANSWERS, TASK)] == [r.reward for r in first]
  assert [r.info["feedback"] for r in reborn.grade_group(ANSWERS, TASK)] == [
      critique(a) for a in ANSWERS]
  assert len(fake.requests) == 3
  # an absolute verdict is not a relative one: a lone call asks once, then is cached
  reborn(ANSWERS[1], TASK)
  reborn(ANSWERS[1], TASK)
  assert len(fake.requests) == 4
  # another rubric is another judgement
  make_grader("judge", _cfg(fake, cache_path=path, rubric=RUBRIC + " Be harsh.")
              ).grade_group(ANSWERS[:1], TASK)
  assert len(fake.requests) == 5


def test_a_reply_wrapped_in_prose_and_fences_parses(fake):
  fake.mode = "prose"
  results = make_grader("judge", _cfg(fake)).grade_group(ANSWERS, TASK)
  assert [r.reward for r in results] == [rule(a) / 10 for a in ANSWERS]
  assert len(fake.requests) == 1


def test_an_endpoint_without_json_mode_is_asked_plainly_from_then_on(fake):
  fake.mode = "no_json_mode"
  judge = make_grader("judge", _cfg(fake))
  assert judge.grade_group(ANSWERS[:2], TASK)[0].reward == 1.0
  assert ["response_format" in r["body"] for r in fake.requests] == [True, False]
  judge.grade_group(ANSWERS[2:], TASK)
  assert ["response_format" in r["body"] for r in fake.requests] == [True, False, False]
  fake.requests.clear()
  with pytest.raises(JudgeError, match="HTTP 400.*response_format"):   # "on": no fallback
    make_grader("judge", _cfg(fake, json_mode="on")).grade_group(ANSWERS, TASK)
  assert len(fake.requests) == 1
  make_grader("judge", _cfg(fake, json_mode="off")).grade_group(ANSWERS, TASK)
  assert "response_format" not in fake.requests[-1]["body"]


@pytest.mark.parametrize("reply,k,want", [
    ('{"scores": [1, "2.5", 0], "critiques": ["a", " ", null]}', 3,
     [(1.0, "a"), (2.5, None), (0.0, None)]),
    ('{"scores": [3, 4]}', 2, [(3.0, None), (4.0, None)]),
    ('{"score": 7, "critique": "ok"}', 1, [(7.0, "ok")]),
    ('{"scores": [7], "critiques": ["ok"]}', 1, [(7.0, "ok")]),
    ('<think>{"score": 50}</think> {"score": 5}', 1, [(5.0, None)]),
    ('{"scores": [1, 2], "critiques": ["x", "y"],}  then {"scores": [2, 1]}', 2,
     [(2.0, None), (1.0, None)]),
])
def test_parse_verdicts(reply, k, want):
  got = parse_verdicts(reply, k, 0.0, 10.0)
  assert [(v.score, v.critique) for v in got] == want


@pytest.mark.parametrize("reply,k,why", [
    ("no json here", 1, "no JSON object"),
    ('{"scores": [1, 2, 3]}', 2, "list of 2 numbers"),
    ('{"scores": [1, 2], "critiques": ["x"]}', 2, "list of 2 strings"),
    ('{"score": 5}', 2, "without 'scores'"),
    ('{"score": 11}', 1, r"outside \[0, 10\]"),
    ('{"score": -1}', 1, "outside"),
    ('{"score": "high"}', 1, "not a number"),
    ('{"score": true}', 1, "not a finite number"),
    ('{"score": NaN}', 1, "not a finite number"),
    ('{"score": 5, "critique": 3}', 1, "not a string"),
])
def test_parse_verdicts_refuses(reply, k, why):
  with pytest.raises(_BadReply, match=why):
    parse_verdicts(reply, k, 0.0, 10.0)


# -- (b) failures: infra errors naming the endpoint, never a reward --------------------------

@pytest.mark.parametrize("mode,attempts,what", [
    ("http500", 3, "HTTP 500.*judge overloaded"),
    ("slow", 3, r"no answer within timeout_s=0\.2"),
    ("garbage", 3, r"unparseable reply \(no JSON object.*They all look fine to me"),
    ("out_of_range", 3, r"score 11\.0 is outside \[0, 10\]"),
    ("wrong_count", 3, "'scores' must be a list of 4 numbers"),
    ("not_completion", 3, "not a chat completion.*hello"),
    ("http401", 1, "refused the request: HTTP 401.*bad key.*not retried"),
])
def test_a_failing_judge_is_a_judge_error_naming_the_endpoint(fake, mode, attempts, what):
  fake.mode = mode
  cfg = _cfg(fake, timeout_s=0.2)
  judge = make_grader("judge", cfg)
  with pytest.raises(JudgeError, match=what) as e:
    judge.grade_group(ANSWERS, TASK)
  assert isinstance(e.value, GraderError)                 # what rollouts and evals treat as ours
  assert f"judge 'fake-judge' at {cfg.base_url}/chat/completions" in str(e.value)
  assert len(fake.requests) == attempts                   # `retries` more after the first
  m = judge.metrics()
  assert (m["judge/failures"], m["judge/retries"]) == (1.0, attempts - 1.0)
  fake.mode = "ok"                                        # a failure is never cached
  assert [r.reward for r in judge.grade_group(ANSWERS, TASK)] == [1.0, 0.6, 0.1, 1.0]


def test_grade_group_returns_failures_in_place(fake):
  """graders/base.py's grade_group, what a rollout calls: a per-completion grader fails per
  completion, a group grader (the judge) for the whole group; failures are returned, not raised."""
  def picky(completion, task):
    if completion == "boom":
      raise GraderError("unreadable")
    return GradeResult(1.0)
  assert [type(r) for r in grade_group(picky, ["a", "boom", "b"], TASK)] == [
      GradeResult, GraderError, GradeResult]
  fake.mode = "garbage"
  out = grade_group(make_grader("judge", _cfg(fake, retries=0)), ANSWERS, TASK)
  assert len(out) == 4 and all(isinstance(r, JudgeError) for r in out)
  assert len(fake.requests) == 1


def test_a_long_bad_reply_is_quoted_truncated(fake):
  fake.mode = "long_garbage"
  with pytest.raises(JudgeError, match=r"zzz\.\.\. \(5000 chars\)") as e:
    make_grader("judge", _cfg(fake, retries=0)).grade_group(ANSWERS, TASK)
  assert len(str(e.value)) < 700


def test_connection_refused_names_the_url():
  url = f"http://127.0.0.1:{_dead_port()}/v1"
  judge = make_grader("judge", JudgeConfig(base_url=url, probe=False, retries=1, backoff_s=0.0))
  with pytest.raises(JudgeError, match=rf"at {re.escape(url)}/chat/completions gave no usable "
                                       r"verdict after 2 attempt\(s\); last: ConnectionRefused"):
    judge("x", TASK)
  with pytest.raises(JudgeConfigError, match=rf"base_url='{re.escape(url)}': the judge endpoint "
                                             rf"{re.escape(url)}/models does not answer"):
    make_grader("judge", JudgeConfig(base_url=url))


@pytest.mark.parametrize("url", ["localhost:8000/v1", "ftp://host/v1", "http:///v1",
                                 "http://host:port/v1"])
def test_a_bad_url_is_refused_by_the_config(url):
  with pytest.raises(ValueError, match=rf"JudgeConfig\.base_url={re.escape(repr(url))}"):
    JudgeConfig(base_url=url)


def test_the_probe_checks_model_and_key(fake, monkeypatch):
  with pytest.raises(JudgeConfigError, match=r"serves \[\"fake-judge\"\], not "
                                             r"JudgeConfig\.model='other'"):
    make_grader("judge", _cfg(fake, model="other"))
  with pytest.raises(JudgeConfigError, match="JUDGE_TEST_KEY.*not set"):
    make_grader("judge", _cfg(fake, api_key_env="JUDGE_TEST_KEY"))
  monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test")
  make_grader("judge", _cfg(fake, api_key_env="JUDGE_TEST_KEY")).grade_group(ANSWERS[:1], TASK)
  assert fake.requests[-1]["auth"] == "Bearer sk-test"


def test_an_unusable_cache_path_is_named(fake, tmp_path):
  (tmp_path / "file").write_text("")
  bad = str(tmp_path / "file" / "verdicts.sqlite")
  with pytest.raises(JudgeConfigError, match=rf"JudgeConfig\.cache_path={re.escape(repr(bad))} "
                                             "cannot be opened"):
    make_grader("judge", _cfg(fake, cache_path=bad))


def test_rollouts_make_judge_failures_infra_errors_and_critiques_feedback(fake):
  """TaskEpisode (actors/rollout.py) with the judge as its grader: a verdict gives the reward
  and the trajectory's feedback; a judge that fails gives infra_error with no reward (never 0)."""
  from tests.support import envs as et
  tok = et.tokenizer("hermes")
  engine = et.ScriptedEngine(tok, lambda prompt, k: "banana PINEAPPLE" if "yellow" in prompt
                             else "an apple", et.stop_ids(tok, "hermes")[0])
  tasks = [TASK, Task(id="fruit:3", prompt="Name a red fruit.", answer="cherry")]
  items = [WorkItem(i, t) for i, t in enumerate(tasks)]
  episode = TaskEpisode(engine, tok, make_grader("judge", _cfg(fake)),
                        RolloutConfig(group_size=1, max_tokens=32), et.stop_ids(tok, "hermes"))
  good = [t for g in episode.run(items, seed=0) for t in g]
  assert [(t.status, t.reward) for t in good] == [(Status.OK, 1.0), (Status.OK, 0.1)]
  assert [t.feedback for t in good] == [critique("banana PINEAPPLE"), critique("an apple")]
  fake.mode = "garbage"
  items = [WorkItem(2 + i, Task(id=f"new:{i}", prompt=t.prompt, answer=t.answer))
           for i, t in enumerate(tasks)]        # new tasks: nothing cached
  bad = [t for g in episode.run(items, seed=1) for t in g]
  assert [(t.status, t.reward) for t in bad] == [(Status.INFRA_ERROR, None)] * 2
  assert all("JudgeError" in t.metrics["error"] and "fake-judge" in t.metrics["error"]
             for t in bad)


class _GroupEngine:
  """The policy's G answers to every prompt, the last one cut by a weight update ("abort")."""
  version = 0

  def __init__(self, tok, texts, stop):
    self.tok, self.texts, self.stop = tok, texts, stop

  def generate(self, prompts, sp, n=1, seed=None):
    from posttrain_jax.engines.base import Completion
    def one(j, text):
      ids = list(self.tok(text, add_special_tokens=False)["input_ids"]) + [self.stop]
      return Completion(token_ids=ids, logprobs=[-0.1] * len(ids), version=0,
                        finish_reason="abort" if j == n - 1 else "stop")
    return [[one(j, t) for j, t in enumerate(self.texts[:n])] for _ in prompts]


def test_rollouts_grade_a_group_in_one_judge_call(fake):
  """With group grading in TaskEpisode (grade_group, graders/base.py): the G - 1 gradable answers
  of a task go to the judge in one call (the aborted one is not sent: infra_error by its finish
  reason); a judge that fails makes all of them infra_error; the judge's counters reach the
  episode's metrics."""
  from tests.support import envs as et
  if not hasattr(TaskEpisode, "metrics"):
    pytest.skip("actors/rollout.py grades completions one by one (no grade_group yet)")
  tok = et.tokenizer("hermes")
  stop = et.stop_ids(tok, "hermes")
  episode = TaskEpisode(_GroupEngine(tok, ANSWERS, stop[0]), tok, make_grader("judge", _cfg(fake)),
                        RolloutConfig(group_size=4, max_tokens=32), stop)
  (group,) = episode.run([WorkItem(0, TASK)], seed=0)
  (req,) = fake.requests
  assert re.findall(r'<answer id="\d+">\n(.*?)\n</answer>',
                    req["body"]["messages"][1]["content"]) == ANSWERS[:3]
  assert [(t.status, t.reward) for t in group] == [
      (Status.OK, 1.0), (Status.OK, 0.6), (Status.OK, 0.1), (Status.INFRA_ERROR, None)]
  assert [t.feedback for t in group[:3]] == [critique(a) for a in ANSWERS[:3]]
  assert episode.metrics()["judge/requests"] == 1.0
  fake.mode = "garbage"
  (group,) = episode.run([WorkItem(1, Task(id="new", prompt=TASK.prompt, answer="banana"))], 1)
  assert [(t.status, t.reward) for t in group] == [(Status.INFRA_ERROR, None)] * 4
  assert all("JudgeError" in t.metrics["error"] for t in group[:3])
  assert episode.metrics()["judge/failures"] == 1.0


# -- the run config ------------------------------------------------------------------------------

def test_judge_settings_come_from_the_run_config():
  cfg = run_config_from_dict({"grader": "judge", "grader_config": {
      "base_url": "http://judge:9000/v1", "model": "m", "rubric": "r", "group": True,
      "cache_path": "/tmp/j.sqlite", "max_score": 1.0}})
  assert cfg.grader_cfg() == JudgeConfig(base_url="http://judge:9000/v1", model="m", rubric="r",
                                         cache_path="/tmp/j.sqlite", max_score=1.0)
  with pytest.raises(ConfigTypeError, match=r"config\.grader_config: JudgeConfig\.base_url="
                                            r"'judge:9000' is not an http\(s\) URL"):
    run_config_from_dict({"grader": "judge", "grader_config": {"base_url": "judge:9000"}})
  with pytest.raises(ConfigTypeError, match=r"JudgeConfig: min_score=5\.0 must be < max_score"):
    run_config_from_dict({"grader": "judge", "grader_config": {"min_score": 5.0,
                                                               "max_score": 5.0}})


def test_the_example_config_loads():
  from tests.support.runs import load_config
  cfg = load_config("judge.py")
  assert cfg.grader == "judge" and cfg.grader_cfg().group and cfg.rl.rollout.group_size > 1
  assert cfg.rl.teacher.context == "feedback"


# -- (c) our own server: launch/serve.py's app on the tiny random model ---------------------------

def test_a_real_served_model_that_answers_garbage_is_an_infra_error(tmp_path):
  """The judge speaks to our proxy (real HTTP, the openai-compatible app launch/serve.py serves)
  on the embedded sampler with a random tiny model: the probe finds the model, json mode is
  refused (no guided decoding) and dropped, each attempt is a real sampled call, and the
  garbage replies end in a JudgeError quoting the last one -- never a reward."""
  from posttrain_jax.engines.jax_sampler import JaxSampler, JaxSamplerConfig
  from posttrain_jax.models import hf_io
  from tests.support import byoh as bt
  from tests.support import envs as et
  tok = et.tokenizer("hermes")
  sampler = JaxSampler(hf_io.load_hf_model(et.tiny_dir("hermes")),
                       JaxSamplerConfig(max_prompt_len=1024, pad_id=tok.pad_token_id))
  with bt.running(sampler, tmp_path / "t.db") as (url, proxy):
    cfg = JudgeConfig(base_url=url + "/v1", model="posttrain_jax", rubric=RUBRIC, max_tokens=12,
                      retries=1, backoff_s=0.0, timeout_s=60.0)
    judge = make_grader("judge", cfg)
    with pytest.raises(JudgeError) as e:
      judge.grade_group(ANSWERS[:2], TASK)
    calls = [c for s in proxy.store.sessions("default")
             for c in proxy.store.calls("default", s["id"])]
    assert not judge._json_mode                           # the proxy refused response_format
  msg = str(e.value)
  assert msg.startswith(f"judge 'posttrain_jax' at {url}/v1/chat/completions gave no usable "
                        "verdict after 2 attempt(s); last: unparseable reply")
  assert len(calls) == 2 and all(c.status == "complete" for c in calls)
  assert all(RUBRIC in json.dumps(c.request) for c in calls)
  last = max(calls, key=lambda c: c.created).choices[0].text
  assert len(last) < 300 and repr(last) in msg           # what came back, quoted
