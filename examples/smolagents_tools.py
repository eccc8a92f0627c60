"""A smolagents `ToolCallingAgent` with a `@tool` on the proxy's Chat Completions API, graded.

    python launch/serve.py                              # in one shell
    python examples/smolagents_tools.py [BASE_URL]      # in another

`OpenAIServerModel` (smolagents' OpenAI-compatible model) sends every step as a
`POST /v1/chat/completions` with the agent's tools, `final_answer` among them. Two tasks in one
memory (`run(..., reset=False)`): convert 100 C to Fahrenheit, then 0 C. smolagents rewrites
its history on each step (earlier tool calls come back as assistant text "Calling tools: ...",
their results as user "Observation: ..." messages), so the proxy records prefix breaks here and
names their reason in the session's samples. Every call carries the session id as
`X-Session-Id`; at the end the last answer is graded (1 if it is 32, else 0; a failed run, 0)
and posted to `/v1/sessions/{id}/feedback`. smolagents sends `tool_choice: "required"`: the proxy
starts the answer with the tool-call opening, draws again while the model still writes no call,
and answers 422 after `--config.proxy.tool_choice_retries` misses, which ends the run. Serve a
real model: the tiny random one launch/serve.py serves by default writes no calls, and its
prompt limit (2048 tokens) is below smolagents' system prompt (2.5k in its 512-token vocabulary).
BASE_URL defaults to $PROXY_BASE_URL or http://127.0.0.1:8000/v1, the key to $PROXY_API_KEY or
"unused" (launch/serve.py without --config.api_keys_file takes any key).
"""
import os
import sys
import uuid

import httpx
from smolagents import OpenAIServerModel, ToolCallingAgent, tool
from smolagents.utils import AgentError


@tool
def celsius_to_fahrenheit(celsius: float) -> float:
  """Converts a temperature from Celsius to Fahrenheit.

  Args:
    celsius: the temperature in degrees Celsius.
  """
  return celsius * 9 / 5 + 32


def main(base_url: str, key: str) -> float:
  session = f"smolagents-{uuid.uuid4().hex[:8]}"
  model = OpenAIServerModel("posttrain_jax", api_base=base_url, api_key=key, max_tokens=256,
                            client_kwargs={"default_headers": {"X-Session-Id": session}})
  agent = ToolCallingAgent(tools=[celsius_to_fahrenheit], model=model, max_steps=4)
  try:
    print("task 1:", agent.run("Convert 100 degrees Celsius to Fahrenheit."))
    answer = agent.run("And 0 degrees Celsius?", reset=False)
  except AgentError as e:    # graded too: a failed run is a failed task
    answer = f"the agent failed: {e}"
  print("task 2:", answer)
  grade = float(str(answer).strip() in ("32", "32.0"))
  r = httpx.post(f"{base_url}/sessions/{session}/feedback", json={"grade": grade},
                 headers={"Authorization": f"Bearer {key}"})
  if r.status_code == 404:   # not one call was recorded: the first was refused (e.g. a prompt
    print(f"session {session}: nothing recorded to grade")   # past the model's context)
    return grade
  r.raise_for_status()
  print(f"session {session}: grade {grade}")
  return grade


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else
       os.environ.get("PROXY_BASE_URL", "http://127.0.0.1:8000/v1"),
       os.environ.get("PROXY_API_KEY", "unused"))
