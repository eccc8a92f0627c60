"""An OpenAI Agents SDK agent with function tools on the proxy's Responses API, graded.

    python launch/serve.py                                   # in one shell
    python examples/openai_agents_responses.py [BASE_URL]    # in another

The agent (`OpenAIResponsesModel`, so every model call is a `POST /v1/responses`) answers two
user turns with a calculator: "What is (12 + 30) * 2?", then "Now divide that by 4." -- the
second run carries the first one's items, so the session is one growing conversation. Every
call carries the session id as `X-Session-Id`; at the end the final answer is graded (1 if it
says 21, else 0; a run the SDK gives up on -- an answer cut at max_tokens, which the Responses
API reports as status "incomplete", or too many turns -- fails the task, 0) and posted to
`/v1/sessions/{id}/feedback`. Tracing is off (no network).
BASE_URL defaults to $PROXY_BASE_URL or http://127.0.0.1:8000/v1, the key to $PROXY_API_KEY or
"unused" (launch/serve.py without --config.api_keys_file takes any key).
"""
import asyncio
import os
import sys
import uuid

import httpx
from agents import (Agent, AgentsException, ModelSettings, OpenAIResponsesModel, Runner,
                    function_tool, set_tracing_disabled)
from openai import AsyncOpenAI


@function_tool
def add(a: float, b: float) -> float:
  """Adds two numbers."""
  return a + b


@function_tool
def multiply(a: float, b: float) -> float:
  """Multiplies two numbers."""
  return a * b


@function_tool
def divide(a: float, b: float) -> float:
  """Divides a by b."""
  return a / b


async def main(base_url: str, key: str) -> float:
  set_tracing_disabled(True)
  session = f"agents-responses-{uuid.uuid4().hex[:8]}"
  client = AsyncOpenAI(base_url=base_url, api_key=key, default_headers={"X-Session-Id": session})
  agent = Agent(name="calculator", instructions="Use the tools for all arithmetic.",
                model=OpenAIResponsesModel("posttrain_jax", client),
                model_settings=ModelSettings(max_tokens=256), tools=[add, multiply, divide])
  try:
    first = await Runner.run(agent, "What is (12 + 30) * 2?", max_turns=6)
    print("turn 1:", first.final_output)
    second = await Runner.run(agent, first.to_input_list() + [
        {"role": "user", "content": "Now divide that by 4."}], max_turns=6)
    answer = str(second.final_output)
  except AgentsException as e:    # graded too: a failed run is a failed task
    answer = f"the agent failed: {e}"
  print("turn 2:", answer)
  grade = float("21" in answer)
  httpx.post(f"{base_url}/sessions/{session}/feedback", json={"grade": grade},
             headers={"Authorization": f"Bearer {key}"}).raise_for_status()
  print(f"session {session}: grade {grade}")
  return grade


if __name__ == "__main__":
  asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else
                   os.environ.get("PROXY_BASE_URL", "http://127.0.0.1:8000/v1"),
                   os.environ.get("PROXY_API_KEY", "unused")))
