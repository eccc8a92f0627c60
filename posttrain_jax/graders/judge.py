"""The "judge" grader: an LLM behind any OpenAI-compatible endpoint scores answers by a rubric
and says what to fix; the score is the reward, the critique the feedback for distillation.

    judge = make_grader("judge", JudgeConfig(base_url="http://127.0.0.1:8000/v1",
                                             model="posttrain_jax", rubric="...", group=True))
    judge.grade_group(["answer 1", "answer 2"], task)   # one call for the group (RULER-style)
    judge("answer 1", task)                              # one answer, an absolute score

The request (`POST {base_url}/chat/completions`, `base_url` as an OpenAI client takes it, with
the /v1): a system message with the rubric and the reply format, a user message

    <task>prompt</task> <reference>task.answer</reference> <answer id="1">...</answer> ...

(the reference only with `show_reference`), `temperature`, `max_tokens`, and
`response_format={"type": "json_object"}` when the endpoint takes it (`json_mode="auto"`: an
endpoint that answers 400/422 naming `response_format` -- our own proxy on an engine without
guided decoding does -- is asked again without it, once per judge). The reply asked for:

    {"scores": [s_1, ..., s_k], "critiques": ["...", ...]}    k answers in one call
    {"score": s, "critique": "..."}                           one answer

Parsing is lenient in form (a `<think>` block, prose or code fences around the JSON, either shape
for one answer, critiques missing) and strict in content: k scores, each a finite number in
[min_score, max_score]. The reward is the score mapped linearly onto [0, 1]:
r = (s - min_score) / (max_score - min_score).

Relative scoring (RULER, OpenPipe ART): with `group=True`, `grade_group` sends the G answers to
one task together and the judge scores them against each other -- within-group ranking is what
a group baseline (GRPO) consumes. A lone `judge(answer, task)` call (the held-out eval) is always
an absolute score. Each critique is asked to stand alone (no "answer 2 is better"): the teacher
that reads it sees one attempt only.

Failures are ours, never the policy's: a connection refused or reset, a timeout (`timeout_s` per
socket operation), an HTTP 408/409/429/5xx, a reply that is not a chat completion or whose
content does not parse are retried `retries` times (backoff `backoff_s`·2^(k-1)); then, and at
once for any other HTTP 4xx (a bad key, a model the server lacks), `JudgeError` (a GraderError)
naming the endpoint, the model and what came back (truncated). The rollout turns it into
`infra_error` for the whole group (excluded from loss and baseline, requeued, counted); the
held-out eval reports NaN. A failure is never cached. A base_url that is not http(s) is refused
by the config; with `probe` the endpoint's /models is asked once when the judge is built, so a
wrong URL, key or model fails the run at start (JudgeConfigError, naming the URL).

Cache: a verdict is keyed by (task: id, prompt, reference shown; answer; model, rubric, score
range; relative or absolute) -- sha256 of those -- and kept in an in-memory LRU of `cache_size`
entries, and, with `cache_path`, in a SQLite file (WAL) that outlives the run and may be shared
by processes: a judge is never asked twice for the same pair. Within a group only the answers
not yet judged are sent (identical answers once); the rest come from the cache. Two threads that
grade the same new pair at the same instant may both ask (the rollouts grade a task's group in
one thread). Counters (`metrics()`): judge/{requests, verdicts, cache_hits, retries, failures}.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import http.client
import json
import math
import os
import pathlib
import re
import sqlite3
import threading
import time
import urllib.parse
from typing import TYPE_CHECKING, Any, Optional, Sequence

from posttrain_jax.errors import UserError
from posttrain_jax.graders.base import GradeResult, GraderError, register_grader

if TYPE_CHECKING:   # graders read tasks, tasks import no grader module at run time
  from posttrain_jax.tasks.task import Task

JSON_MODES = ("auto", "on", "off")
DEFAULT_RUBRIC = ("Judge whether the answer solves the task. A correct, complete answer that "
                  "states its result clearly scores high; a wrong, incomplete, empty or evasive "
                  "answer scores low. Judge the answer's substance, not its length or style.")
_RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
_KEY_VERSION = 1          # bump when the prompt changes what a cached verdict means
_SHOW = 300               # characters of a bad reply quoted in an error


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
  """Config of the "judge" grader."""
  base_url: str = "http://127.0.0.1:8000/v1"  # OpenAI-compatible API root, with /v1 (as an
                                              # OpenAI client takes it; launch/serve.py's default)
  model: str = "posttrain_jax"        # the judge model's name on that endpoint
  api_key: Optional[str] = None       # sent as `Authorization: Bearer`; prefer api_key_env
  api_key_env: Optional[str] = None   # name of the environment variable holding the key
  rubric: str = DEFAULT_RUBRIC        # what a good answer is, in the judge's own words
  group: bool = True                  # grade_group scores a task's G answers in one call,
                                      # relative to each other (RULER); False: one call each
  min_score: float = 0.0              # the worst score the judge may give (reward 0)
  max_score: float = 10.0             # the best (reward 1)
  show_reference: bool = True         # show the task's reference answer (when it has one)
  temperature: float = 0.0            # the judge's sampling temperature
  max_tokens: int = 1024              # the judge's reply budget (critiques for G answers)
  timeout_s: float = 60.0             # per socket operation (connect, each read)
  retries: int = 2                    # further attempts after a failed or unparseable reply
  backoff_s: float = 1.0              # wait before retry k: backoff_s * 2**(k-1)
  json_mode: str = "auto"             # response_format json_object: auto | on | off (docstring)
  max_concurrency: int = 8            # parallel requests of one group when group=False
  cache_size: int = 100_000           # verdicts kept in memory (LRU); 0 = none in memory
  cache_path: Optional[str] = None    # SQLite file of verdicts, kept across runs; None = memory
  probe: bool = True                  # ask {base_url}/models once at build: fail fast, clearly

  def __post_init__(self):
    url = urllib.parse.urlsplit(self.base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
      raise ValueError(f"JudgeConfig.base_url={self.base_url!r} is not an http(s) URL (e.g. "
                       "'http://127.0.0.1:8000/v1', the API root an OpenAI client takes)")
    try:
      url.port
    except ValueError:
      raise ValueError(f"JudgeConfig.base_url={self.base_url!r} has a bad port") from None
    if not self.model:
      raise ValueError("JudgeConfig.model is empty: name the judge model the endpoint serves")
    if not self.rubric.strip():
      raise ValueError("JudgeConfig.rubric is empty: say what a good answer is")
    if self.api_key is not None and self.api_key_env is not None:
      raise ValueError("JudgeConfig: set api_key or api_key_env, not both")
    if not (math.isfinite(self.min_score) and math.isfinite(self.max_score)
            and self.min_score < self.max_score):
      raise ValueError(f"JudgeConfig: min_score={self.min_score} must be < max_score="
                       f"{self.max_score} (both finite)")
    if self.json_mode not in JSON_MODES:
      raise ValueError(f"JudgeConfig.json_mode is {self.json_mode!r}; valid: {JSON_MODES}")
    for name in ("max_tokens", "max_concurrency"):
      if getattr(self, name) < 1:
        raise ValueError(f"JudgeConfig.{name} must be ≥ 1, got {getattr(self, name)}")
    for name in ("retries", "cache_size"):
      if getattr(self, name) < 0:
        raise ValueError(f"JudgeConfig.{name} must be ≥ 0, got {getattr(self, name)}")
    for name in ("temperature", "backoff_s"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"JudgeConfig.{name} must be ≥ 0, got {getattr(self, name)}")
    if not self.timeout_s > 0:
      raise ValueError(f"JudgeConfig.timeout_s must be > 0, got {self.timeout_s}")


class JudgeError(GraderError):
  """The judge gave no usable verdict (unreachable, HTTP error, timeout, unparseable reply after
  the retries): an infra error, never a reward. The message names the endpoint."""


class JudgeConfigError(UserError, ValueError):
  """The judge cannot be used at all (the probe failed, the key's variable is unset, the cache
  file cannot be opened): the run stops at start with this one line."""


class _Retryable(Exception):
  """One attempt failed in a way another attempt may not."""


class _BadReply(ValueError):
  """The judge's content holds no verdict of the asked shape."""


@dataclasses.dataclass(frozen=True)
class Verdict:
  """The judge's word on one answer."""
  score: float                      # on the judge's scale [min_score, max_score]
  critique: Optional[str]           # free text for the answer's author (None: none given)


# -- the prompt and the reply ------------------------------------------------------------------

def judge_messages(cfg: JudgeConfig, task: Task, answers: Sequence[str]) -> list[dict]:
  """The chat sent to the judge for `answers` (one, or a group) to `task`."""
  lo, hi, k = _num(cfg.min_score), _num(cfg.max_score), len(answers)
  lines = ["You are a strict, fair judge. Score answers to a task by this rubric:",
           "<rubric>", cfg.rubric.strip(), "</rubric>",
           f"A score is a number from {lo} (worst) to {hi} (best)."]
  if k == 1:
    lines += ["Write a short critique that tells the answer's author what is wrong and how to "
              "fix it (or why it is right).",
              "Reply with one JSON object and nothing else: "
              '{"score": <number>, "critique": "<text>"}']
  else:
    lines += [f"You are shown {k} answers to the same task. Compare them with each other: a "
              "better answer gets a higher score, equally good answers get equal scores.",
              "For each answer write a short critique that tells its author what is wrong and "
              "how to fix it (or why it is right); each critique must stand alone -- never refer "
              "to the other answers or their numbers.",
              f"Reply with one JSON object and nothing else: {{\"scores\": [<{k} numbers>], "
              f"\"critiques\": [<{k} strings>]}}, both in the order of the answers."]
  user = [f"<task>\n{task.prompt_text}\n</task>"]
  if cfg.show_reference and task.answer.strip():
    user.append(f"<reference>\n{task.answer}\n</reference>")
  user += [f'<answer id="{i + 1}">\n{a}\n</answer>' for i, a in enumerate(answers)]
  return [{"role": "system", "content": "\n".join(lines)},
          {"role": "user", "content": "\n".join(user)}]


_THINK = re.compile(r"<think>.*?</think>", re.S)


def parse_verdicts(content: str, k: int, min_score: float, max_score: float) -> list[Verdict]:
  """The `k` verdicts in a judge's reply; `_BadReply` saying what is wrong when there are none.
  The first JSON object in the text that holds k valid verdicts wins."""
  text = _THINK.sub("", content)
  problems = []
  for obj in _json_objects(text):
    try:
      return _verdicts(obj, k, min_score, max_score)
    except _BadReply as e:
      problems.append(str(e))
  raise _BadReply(problems[0] if problems else "no JSON object in the reply")


def _json_objects(text: str):
  decoder, i = json.JSONDecoder(), text.find("{")
  while i != -1:
    try:
      obj, end = decoder.raw_decode(text, i)
    except json.JSONDecodeError:
      i = text.find("{", i + 1)
      continue
    if isinstance(obj, dict):
      yield obj
    i = text.find("{", end)


def _verdicts(obj: dict, k: int, lo: float, hi: float) -> list[Verdict]:
  if "scores" in obj:
    scores, critiques = obj["scores"], obj.get("critiques")
    if not isinstance(scores, list) or len(scores) != k:
      raise _BadReply(f"'scores' must be a list of {k} numbers, got {_short(scores)}")
    if critiques is None:
      critiques = [None] * k
    elif not isinstance(critiques, list) or len(critiques) != k:
      raise _BadReply(f"'critiques' must be a list of {k} strings, got {_short(critiques)}")
  elif "score" in obj and k == 1:
    scores, critiques = [obj["score"]], [obj.get("critique")]
  else:
    raise _BadReply(f"a JSON object without {'score' if k == 1 else 'scores'!r}: {_short(obj)}")
  return [Verdict(_score(s, lo, hi), _critique(c)) for s, c in zip(scores, critiques)]


def _score(s: Any, lo: float, hi: float) -> float:
  if isinstance(s, str):
    try:
      s = float(s.strip())
    except ValueError:
      raise _BadReply(f"score {s!r} is not a number") from None
  if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
    raise _BadReply(f"score {_short(s)} is not a finite number")
  if not lo <= s <= hi:
    raise _BadReply(f"score {s} is outside [{_num(lo)}, {_num(hi)}]")
  return float(s)


def _critique(c: Any) -> Optional[str]:
  if c is None:
    return None
  if not isinstance(c, str):
    raise _BadReply(f"critique {_short(c)} is not a string")
  return c.strip() or None


def _num(x: float) -> str:
  return str(int(x)) if float(x).is_integer() else str(x)


def _short(x: Any, n: int = _SHOW) -> str:
  s = x if isinstance(x, str) else json.dumps(x, ensure_ascii=False, default=str)
  return s if len(s) <= n else f"{s[:n]}... ({len(s)} chars)"


# -- the cache ---------------------------------------------------------------------------------

class _Cache:
  """An in-memory LRU of verdicts in front of an optional SQLite file; thread-safe."""

  def __init__(self, size: int, path: Optional[str]):
    self._size, self._mem = size, collections.OrderedDict()
    self._lock = threading.Lock()
    self._db: Optional[sqlite3.Connection] = None
    if path is not None:
      try:
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, score REAL "
                         "NOT NULL, critique TEXT, model TEXT, created REAL)")
        self._db.commit()
      except (OSError, sqlite3.Error) as e:
        raise JudgeConfigError(f"JudgeConfig.cache_path={path!r} cannot be opened as a SQLite "
                               f"file ({type(e).__name__}: {e}); choose a writable path") from e

  def get(self, key: str) -> Optional[Verdict]:
    with self._lock:
      if key in self._mem:
        self._mem.move_to_end(key)
        return self._mem[key]
      if self._db is None:
        return None
      row = self._db.execute("SELECT score, critique FROM verdicts WHERE key = ?",
                             (key,)).fetchone()
      if row is None:
        return None
      v = Verdict(float(row[0]), row[1])
      self._remember(key, v)
      return v

  def put(self, key: str, v: Verdict, model: str) -> None:
    with self._lock:
      self._remember(key, v)
      if self._db is not None:
        self._db.execute("INSERT OR REPLACE INTO verdicts VALUES (?, ?, ?, ?, ?)",
                         (key, v.score, v.critique, model, time.time()))
        self._db.commit()

  def _remember(self, key: str, v: Verdict) -> None:
    if self._size:
      self._mem[key] = v
      self._mem.move_to_end(key)
      while len(self._mem) > self._size:
        self._mem.popitem(last=False)

  def close(self) -> None:
    with self._lock:
      if self._db is not None:
        self._db.close()
        self._db = None


# -- the grader --------------------------------------------------------------------------------

@register_grader("judge", JudgeConfig, stateful=True)
class Judge:
  """A judge client with its cache and counters (module docstring); `make_grader("judge", cfg)`
  builds one per run."""

  def __init__(self, cfg: JudgeConfig):
    self.cfg = cfg
    root = cfg.base_url.rstrip("/")
    self.url = root + "/chat/completions"
    self._models_url = root + "/models"
    self._split = urllib.parse.urlsplit(self.url)
    self._auth = _api_key(cfg)
    self._json_mode = cfg.json_mode != "off"
    self._lock = threading.Lock()
    self._counts = dict.fromkeys(("requests", "verdicts", "cache_hits", "retries", "failures"), 0)
    self._window = dict(self._counts)
    if cfg.probe:
      self._probe()
    self._cache = _Cache(cfg.cache_size, cfg.cache_path)

  # -- the grader protocol (base.py) -----------------------------------------------------------

  def __call__(self, completion: str, task: Task) -> GradeResult:
    """One answer, an absolute score."""
    return self._grade([completion], task, relative=False)[0]

  def grade_group(self, completions: Sequence[str], task: Task) -> list[GradeResult]:
    """A task's answers: scored together in one call (`group=True`), else one call each (run
    concurrently); answers judged before come from the cache."""
    return self._grade(list(completions), task, relative=self.cfg.group)

  def metrics(self) -> dict[str, float]:
    """judge/<counter> since the last call, and judge/total/<counter>."""
    with self._lock:
      out = {f"judge/{k}": float(v - self._window[k]) for k, v in self._counts.items()}
      out.update({f"judge/total/{k}": float(v) for k, v in self._counts.items()})
      self._window = dict(self._counts)
    return out

  def close(self) -> None:
    self._cache.close()

  # -- grading ---------------------------------------------------------------------------------

  def _grade(self, answers: list[str], task: Task, relative: bool) -> list[GradeResult]:
    keys = [self._key(task, a, relative) for a in answers]
    known: dict[str, Verdict] = {}
    hits = set()
    todo: dict[str, str] = {}           # key -> answer, first occurrence order, each once
    for key, answer in zip(keys, answers):
      if key in known or key in todo:
        continue
      v = self._cache.get(key)
      if v is None:
        todo[key] = answer
      else:
        known[key] = v
        hits.add(key)
    self._count("cache_hits", sum(k in hits for k in keys))
    if todo:
      try:
        fresh = (self._ask(task, list(todo.values())) if relative
                 else self._ask_each(task, list(todo.values())))
      except JudgeError:
        self._count("failures", 1)
        raise
      for key, v in zip(todo, fresh):
        self._cache.put(key, v, self.cfg.model)
        known[key] = v
      self._count("verdicts", len(todo))
    return [self._result(known[k], k in hits, len(todo), relative) for k in keys]

  def _result(self, v: Verdict, cached: bool, asked: int, relative: bool) -> GradeResult:
    lo, hi = self.cfg.min_score, self.cfg.max_score
    reward = min(max((v.score - lo) / (hi - lo), 0.0), 1.0)
    return GradeResult(reward, {"parse_ok": True, "judge_score": v.score, "feedback": v.critique,
                                "judge_cached": cached, "judge_relative": relative,
                                "judge_answers_asked": asked})

  def _key(self, task: Task, answer: str, relative: bool) -> str:
    cfg = self.cfg
    ref = task.answer if cfg.show_reference else None
    blob = json.dumps([_KEY_VERSION, "relative" if relative else "absolute", cfg.model,
                       cfg.rubric, cfg.min_score, cfg.max_score, task.id, task.prompt_text, ref,
                       answer], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()

  def _ask_each(self, task: Task, answers: list[str]) -> list[Verdict]:
    if len(answers) == 1:
      return self._ask(task, answers)
    n = min(self.cfg.max_concurrency, len(answers))
    with concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="judge") as pool:
      futures = [pool.submit(self._ask, task, [a]) for a in answers]
      concurrent.futures.wait(futures)   # every verdict that came is used (and cached)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
      raise errors[0]
    return [f.result()[0] for f in futures]

  def _ask(self, task: Task, answers: list[str]) -> list[Verdict]:
    """The judge's verdicts on `answers` (one call), after up to `retries` more attempts."""
    cfg, last = self.cfg, ""
    messages = judge_messages(cfg, task, answers)
    for attempt in range(cfg.retries + 1):
      if attempt:
        self._count("retries", 1)
        time.sleep(cfg.backoff_s * 2 ** (attempt - 1))
      try:
        content, finish = self._complete(messages)
      except _Retryable as e:
        last = str(e)
        continue
      try:
        return parse_verdicts(content, len(answers), cfg.min_score, cfg.max_score)
      except _BadReply as e:
        hint = " -- raise JudgeConfig.max_tokens" if finish == "length" else ""
        last = (f"unparseable reply ({e}; finish_reason {finish!r}{hint}): "
                f"{_short(content)!r}")
    raise JudgeError(f"judge {cfg.model!r} at {self.url} gave no usable verdict after "
                     f"{cfg.retries + 1} attempt(s); last: {last}")

  # -- HTTP ------------------------------------------------------------------------------------

  def _complete(self, messages: list[dict]) -> tuple[str, Optional[str]]:
    """(content, finish_reason) of one chat completion; _Retryable or JudgeError otherwise."""
    cfg = self.cfg
    body = {"model": cfg.model, "messages": messages, "temperature": cfg.temperature,
            "max_tokens": cfg.max_tokens}
    json_mode = self._json_mode
    if json_mode:
      body["response_format"] = {"type": "json_object"}
    self._count("requests", 1)
    status, text = self._http("POST", self._split, body)
    if (json_mode and cfg.json_mode == "auto" and status in (400, 422)
        and "response_format" in text):
      self._json_mode = False           # this endpoint cannot constrain output: ask plainly
      del body["response_format"]
      self._count("requests", 1)
      status, text = self._http("POST", self._split, body)
    if status in _RETRY_STATUSES:
      raise _Retryable(f"HTTP {status}: {_short(text)!r}")
    if status >= 400:
      raise JudgeError(f"judge {cfg.model!r} at {self.url} refused the request: HTTP {status}: "
                       f"{_short(text)!r} (not retried: check JudgeConfig.model / api_key / "
                       "max_tokens)")
    try:
      choice = json.loads(text)["choices"][0]
      content, finish = choice["message"]["content"], choice.get("finish_reason")
    except (ValueError, KeyError, IndexError, TypeError):
      raise _Retryable(f"not a chat completion: {_short(text)!r}") from None
    if not isinstance(content, str):
      raise _Retryable(f"a reply without text content (finish_reason {finish!r}): "
                       f"{_short(text)!r}")
    return content, finish

  def _http(self, method: str, split, body: Optional[dict] = None) -> tuple[int, str]:
    """(status, body text) of one request on a fresh connection; _Retryable when no answer."""
    conn_cls = (http.client.HTTPSConnection if split.scheme == "https"
                else http.client.HTTPConnection)
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if self._auth:
      headers["Authorization"] = f"Bearer {self._auth}"
    path = (split.path or "/") + (f"?{split.query}" if split.query else "")
    data = None if body is None else json.dumps(body).encode()
    conn = conn_cls(split.hostname, split.port, timeout=self.cfg.timeout_s)
    try:
      conn.request(method, path, body=data, headers=headers)
      resp = conn.getresponse()
      return resp.status, resp.read().decode("utf-8", errors="replace")
    except TimeoutError:
      raise _Retryable(f"no answer within timeout_s={self.cfg.timeout_s}") from None
    except (OSError, http.client.HTTPException) as e:
      raise _Retryable(f"{type(e).__name__}: {e}") from None
    finally:
      conn.close()

  def _probe(self) -> None:
    """GET /models once: an unreachable endpoint, a refused key or an unlisted model stops the
    run at start. An endpoint without /models (404) is taken on trust."""
    where = f"JudgeConfig.base_url={self.cfg.base_url!r}"
    try:
      status, text = self._http("GET", urllib.parse.urlsplit(self._models_url))
    except _Retryable as e:
      raise JudgeConfigError(f"{where}: the judge endpoint {self._models_url} does not answer "
                             f"({e}); start the server or fix the URL (probe=False skips this "
                             "check)") from None
    if status == 404:
      return
    if status >= 400:
      raise JudgeConfigError(f"{where}: GET {self._models_url} answered HTTP {status}: "
                             f"{_short(text)!r} (a key? JudgeConfig.api_key_env)")
    try:
      served = [m["id"] for m in json.loads(text)["data"]]
    except (ValueError, KeyError, TypeError):
      return                            # not a model list: nothing to check against
    if served and self.cfg.model not in served:
      raise JudgeConfigError(f"{where} serves {_short(served)}, not JudgeConfig.model="
                             f"{self.cfg.model!r}")

  def _count(self, name: str, n: int) -> None:
    with self._lock:
      self._counts[name] += n


def _api_key(cfg: JudgeConfig) -> Optional[str]:
  if cfg.api_key_env is None:
    return cfg.api_key
  key = os.environ.get(cfg.api_key_env)
  if not key:
    raise JudgeConfigError(f"JudgeConfig.api_key_env={cfg.api_key_env!r}: that environment "
                           "variable is not set (or empty); export the judge's API key in it")
  return key
