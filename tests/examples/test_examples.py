"""The harness examples of examples/, each run as a user runs it (its own process, the real SDK)
against the real proxy (uvicorn in a thread, tests/support/byoh.py), and checked as recorded.

The policy is a ScriptedEngine (the tiny random model never writes a tool call): it answers call
k with the k-th scripted text, less whatever the prompt already ends with (a forced tool_choice
starts the assistant turn with the call opening as prompt tokens, byoh/server.py). Each case
asserts: the example exits 0; the engine's calls are the store's calls one for one, complete,
their prompt and sampled ids the engine's, through the dialect the harness speaks; the tools
really ran (their results reached the model's next prompt); each session rebuilds from exactly
those ids -- one sample where the harness keeps its history, breaks counted by reason where it
rewrites it; the example's grade is stored as the session's feedback.
"""
import dataclasses
import importlib
import json
import pathlib
import subprocess
import sys
import types

import httpx
import pytest

from tests.support import byoh as bt
from tests.support import envs as et

ROOT = pathlib.Path(__file__).resolve().parents[2]


def call(name: str, **args) -> str:
  """One hermes-format tool call, as a model writes it."""
  return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


@dataclasses.dataclass(frozen=True)
class Case:
  example: str                 # examples/<example>.py
  needs: str                   # the module the example imports (not importable: a skip)
  texts: tuple[str, ...]       # the engine's answers, call by call
  tool_results: tuple[str, ...]  # what the tools returned, in the last prompt of its session
  grades: tuple[float, ...]    # the grade posted for each session, in order
  id_prefix: str               # the id the dialect gives a call
  breaks: tuple[tuple[str, int], ...] = ()   # per session: (reason, count) of prefix breaks
  args: tuple[str, ...] = ()   # after the base URL
  streamed: bool = False       # every call asked to stream
  tool_choice: str | None = None  # what every call asked for ("required": the proxy prefills)
  label: str = ""              # the test id, where one example has several cases


CASES = [
    Case("openai_agents_responses", "agents",
         (call("add", a=12, b=30), call("multiply", a=42, b=2), "(12 + 30) * 2 = 84.",
          call("divide", a=84, b=4), "84 / 4 = 21."),
         ("42.0", "84.0", "21.0"), (1.0,), "resp_"),
    # a model that never stops calling tools: the SDK gives up after max_turns=6, the example
    # grades the failed run 0
    Case("openai_agents_responses", "agents", (call("add", a=12, b=30),) * 6, ("42.0",), (0.0,),
         "resp_", label="openai_agents_responses-max_turns"),
    Case("openai_agents_chat", "agents",
         (call("lookup", country="France"), "Paris; 2.1 million people.",
          call("lookup", country="Japan"), "Tokyo; 14 million people."),
         ("capital Paris, population 2.1 million", "capital Tokyo, population 14 million"),
         (1.0,), "chatcmpl-", streamed=True),
    Case("anthropic_tool_loop", "anthropic",
         (call("area", width=3, length=4), "12 square meters.", call("area", width=5, length=6),
          "30 square meters."),
         ("12", "30"), (1.0,), "msg_"),
    # smolagents re-renders its memory on every step: earlier calls come back as assistant text,
    # their results as user "Observation:" turns -- each call after the first a history edit
    Case("smolagents_tools", "smolagents",
         (call("celsius_to_fahrenheit", celsius=100), call("final_answer", answer="212"),
          call("celsius_to_fahrenheit", celsius=0), call("final_answer", answer="32")),
         ("Observation:\n212.0", "Observation:\n32.0"), (1.0,), "chatcmpl-",
         breaks=(("history_edited", 3),), tool_choice="required"),
    # BFCL's own loop on two entries, its simulated travel API answering the calls; the second
    # entry's second turn sets the wrong budget, so BFCL's checker fails it
    Case("bfcl_multi_turn", "bfcl_eval.model_handler.api_inference.openai_completion",
         (call("get_flight_cost", travel_from="RMS", travel_to="SBK", travel_date="2026-10-06",
               travel_class="economy"), "Done.",
          call("compute_exchange_rate", base_currency="GBP", target_currency="USD",
               value=15400.0) + "\n" + call("set_budget_limit", access_token="abc123token",
                                            budget_limit=22000.0), "Done.",
          call("get_flight_cost", travel_from="ORD", travel_to="SVP", travel_date="2026-07-14",
               travel_class="business"), "Done.",
          call("set_budget_limit", access_token="abc123xyz456", budget_limit=1.0), "Done."),
         ('{"travel_cost_list": [220.0]}', '{"exchanged_value": 22000.0}',
          '{"budget_limit": 22000.0}', '{"travel_cost_list": [1520.0]}', '{"budget_limit": 1.0}'),
         (1.0, 0.0), "chatcmpl-",
         args=("multi_turn_base_150", "multi_turn_base_182")),
]


def prefill_aware(texts):
  """The script: call k's text, less the longest head of it the prompt already ends with."""
  def script(prompt: str, k: int) -> str:
    text = texts[min(k, len(texts) - 1)]
    for n in range(len(text), 0, -1):
      if prompt.endswith(text[:n]):
        return text[n:]
    return text
  return script


def check_samples(url: str, session: str, view, stop_id: int, breaks: dict) -> None:
  """The session's samples are the engine's ids: one sample of them all (bt.check_one_sample)
  where nothing broke, else the breaks counted by reason and, since each call broke, one sample
  per call of exactly its prompt and sampled ids."""
  if not breaks:
    bt.check_one_sample(url, session, view, stop_id)
    return
  got = httpx.get(f"{url}/v1/sessions/{session}/samples").json()
  assert {k[len("break/"):]: v for k, v in got["stats"].items() if k.startswith("break/")} == (
      breaks)
  assert sum(breaks.values()) == len(view.prompts) - 1
  assert [s["token_ids"] for s in got["samples"]] == [
      p + r for p, r in zip(view.prompts, view.returned)]
  assert [s["loss_mask"] for s in got["samples"]] == [
      [0] * len(p) + [1] * len(r) for p, r in zip(view.prompts, view.returned)]


@pytest.mark.parametrize("case", CASES, ids=[c.label or c.example for c in CASES])
def test_example_runs_and_is_recorded_token_exactly(tmp_path, case):
  try:
    importlib.import_module(case.needs)
  except ImportError as e:
    pytest.skip(f"examples/{case.example}.py needs {case.needs}, which is not importable: {e}")
  tok = et.tokenizer("hermes")
  engine = et.ScriptedEngine(tok, prefill_aware(case.texts), et.stop_ids(tok, "hermes")[0])
  with bt.running(engine, tmp_path / "t.db") as (url, proxy):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / f"{case.example}.py"),
                          url + "/v1", *case.args], capture_output=True, text=True, timeout=240,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    calls = proxy.store.calls("default")
    assert engine.calls == len(case.texts) == len(calls)
    assert [(c.status, c.id[:len(case.id_prefix)]) for c in calls] == [
        ("complete", case.id_prefix)] * len(calls)
    assert [c.prompt_ids for c in calls] == engine.prompts
    assert [[ch.token_ids for ch in c.choices] for c in calls] == [[r] for r in engine.returned]
    assert [bool(c.request.get("stream")) for c in calls] == [case.streamed] * len(calls)
    assert [c.request.get("tool_choice") for c in calls] == [case.tool_choice] * len(calls)
    sessions = list(dict.fromkeys(c.session for c in calls))
    assert len(sessions) == len(case.grades)
    tool_results = []
    for session, grade in zip(sessions, case.grades):
      mine = [i for i, c in enumerate(calls) if c.session == session]
      last = calls[mine[-1]].prompt_text
      tool_results += [r for r in case.tool_results if r in last]
      view = types.SimpleNamespace(prompts=[engine.prompts[i] for i in mine],
                                   returned=[engine.returned[i] for i in mine],
                                   texts=[engine.texts[i] for i in mine])
      check_samples(url, session, view, proxy.stop_ids[0], dict(case.breaks))
      (fb,) = httpx.get(f"{url}/v1/sessions/{session}").json()["feedback"]
      assert fb["grade"] == grade, fb
    assert tool_results == list(case.tool_results)

