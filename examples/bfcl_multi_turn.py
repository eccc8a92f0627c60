"""BFCL's own OpenAI-compatible generation harness on BFCL multi-turn entries, graded by BFCL's
own multi-turn checker.

    python launch/serve.py                                           # in one shell
    python examples/bfcl_multi_turn.py [BASE_URL [ENTRY_ID ...]]     # in another

Each entry (default: the first three of `multi_turn_base`) runs through
`OpenAICompletionsHandler.inference` -- the method `bfcl generate` calls per entry: BFCL's FC
loop of user turns and tool steps on `/v1/chat/completions`, executing the calls in BFCL's own
simulated file system / trading / travel APIs -- as its own session, then
`multi_turn_checker` (what `bfcl evaluate` runs) grades it and the grade is posted to
`/v1/sessions/{id}/feedback`.

Pointing BFCL at the proxy needs no patch: the handler reads `OPENAI_BASE_URL`,
`OPENAI_API_KEY` and `OPENAI_DEFAULT_HEADERS` (a JSON object: the session's `X-Session-Id`)
when it is built. What is adapted is only the entry point: `bfcl generate --model NAME` looks
NAME up in `bfcl_eval.constants.model_config`, which imports every vendor SDK its handlers use
(bfcl-eval is installed with --no-deps, see posttrain_jax/tasks/bfcl.py) and has no entry for a
model named "posttrain_jax"; so the handler is built here, as that registry would build an
OpenAI FC model's, an error is the entry's result as `bfcl generate` records it (graded 0), and
the results are decoded as `bfcl evaluate` decodes them.
BASE_URL defaults to $PROXY_BASE_URL or http://127.0.0.1:8000/v1, the key to $PROXY_API_KEY or
"unused" (launch/serve.py without --config.api_keys_file takes any key).
"""
import copy
import json
import os
import sys
import uuid

import httpx
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import is_empty_execute_response
from bfcl_eval.model_handler.api_inference.openai_completion import OpenAICompletionsHandler
from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry

CATEGORY = "multi_turn_base"


def decoded(handler, result: list[list]) -> list[list[list[str]]]:
  """Each turn's steps as BFCL's checker takes them (`bfcl evaluate`'s decoding, in
  eval_runner.py, which imports that registry too): the steps that decode into calls, each a
  list of "f(a=1)" strings."""
  turns = []
  for steps in result:
    turn = []
    for step in steps:
      try:
        calls = handler.decode_execute(step, has_tool_call_tag=False)
      except Exception:          # text, not calls: BFCL skips it too
        continue
      if not is_empty_execute_response(calls):
        turn.append(calls)
    turns.append(turn)
  return turns


def run_entry(entry: dict, truth: list, base_url: str, key: str) -> float:
  session = f"bfcl-{entry['id']}-{uuid.uuid4().hex[:8]}"
  os.environ.update(OPENAI_BASE_URL=base_url, OPENAI_API_KEY=key,
                    OPENAI_DEFAULT_HEADERS=json.dumps({"X-Session-Id": session}))
  handler = OpenAICompletionsHandler(model_name="posttrain_jax", temperature=0.001,
                                     registry_name="posttrain_jax-FC", is_fc_model=True)
  try:
    result, _ = handler.inference(copy.deepcopy(entry), include_input_log=False,
                                  exclude_state_log=True)
  except Exception as e:   # as `bfcl generate` does: the error is the entry's result, graded 0
    result = f"Error during inference: {e}"
  check = {"valid": False, "error_message": f"force-terminated or failed: {str(result)[:300]}"}
  if isinstance(result, list) and len(result) == len(truth):
    check = multi_turn_checker(decoded(handler, result), truth, entry, CATEGORY,
                               handler.model_name_underline_replaced)
  grade = float(check["valid"])
  r = httpx.post(f"{base_url}/sessions/{session}/feedback",
                 json={"grade": grade, "text": check.get("error_message", "valid")},
                 headers={"Authorization": f"Bearer {key}"})
  if r.status_code == 404:   # not one call was recorded: the first was refused (e.g. a prompt
    print(f"{entry['id']}: session {session}, nothing recorded to grade")  # past the context)
    return grade
  r.raise_for_status()
  print(f"{entry['id']}: session {session}, grade {grade}")
  return grade


def main(base_url: str, key: str, ids: list[str]) -> float:
  entries = load_dataset_entry(CATEGORY)
  truth = {t["id"]: t["ground_truth"] for t in load_ground_truth_entry(CATEGORY)}
  chosen = [e for e in entries if e["id"] in ids] if ids else entries[:3]
  grades = [run_entry(e, truth[e["id"]], base_url, key) for e in chosen]
  print(f"accuracy {sum(grades) / len(grades):.3f} over {len(grades)} entries")
  return sum(grades) / len(grades)


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else
       os.environ.get("PROXY_BASE_URL", "http://127.0.0.1:8000/v1"),
       os.environ.get("PROXY_API_KEY", "unused"), sys.argv[2:])
