"""An OpenAI Agents SDK agent with a lookup tool on the proxy's Chat Completions API, streamed,
graded.

    python launch/serve.py                               # in one shell
    python examples/openai_agents_chat.py [BASE_URL]     # in another

The agent (`OpenAIChatCompletionsModel`: every model call is a streamed
`POST /v1/chat/completions`, the agent run with `Runner.run_streamed`) answers two user turns
with a lookup tool: "What is the capital of France and how many people live there?", then
"And of Japan?" -- the second run carries the first one's items, so the session is one growing
conversation. Every call carries the session id as `X-Session-Id`; at the end the last answer is
graded (1 if it names Tokyo, else 0; a run the SDK gives up on, 0) and posted to
`/v1/sessions/{id}/feedback`. Tracing is off.
BASE_URL defaults to $PROXY_BASE_URL or http://127.0.0.1:8000/v1, the key to $PROXY_API_KEY or
"unused" (launch/serve.py without --config.api_keys_file takes any key).
"""
import asyncio
import os
import sys
import uuid

import httpx
from agents import (Agent, AgentsException, ModelSettings, OpenAIChatCompletionsModel, Runner,
                    function_tool, set_tracing_disabled)
from openai import AsyncOpenAI

FACTS = {"france": "capital Paris, population 2.1 million",
         "japan": "capital Tokyo, population 14 million"}


@function_tool
def lookup(country: str) -> str:
  """The capital of a country and the capital's population."""
  return FACTS.get(country.strip().lower(), f"no data for {country}")


async def run(agent: Agent, items):
  """One streamed agent run: prints the answer's text as it arrives, returns the finished run."""
  result = Runner.run_streamed(agent, items, max_turns=6)
  async for event in result.stream_events():
    if event.type == "raw_response_event" and event.data.type == "response.output_text.delta":
      print(event.data.delta, end="", flush=True)
  print()
  return result


async def main(base_url: str, key: str) -> float:
  set_tracing_disabled(True)
  session = f"agents-chat-{uuid.uuid4().hex[:8]}"
  client = AsyncOpenAI(base_url=base_url, api_key=key, default_headers={"X-Session-Id": session})
  agent = Agent(name="atlas", instructions="Answer with the lookup tool's facts.",
                model=OpenAIChatCompletionsModel("posttrain_jax", client),
                model_settings=ModelSettings(max_tokens=256), tools=[lookup])
  try:
    first = await run(agent, "What is the capital of France and how many people live there?")
    second = await run(agent, first.to_input_list() + [
        {"role": "user", "content": "And of Japan?"}])
    answer = str(second.final_output)
  except AgentsException as e:    # graded too: a failed run is a failed task
    answer = f"the agent failed: {e}"
  grade = float("Tokyo" in answer)
  httpx.post(f"{base_url}/sessions/{session}/feedback", json={"grade": grade},
             headers={"Authorization": f"Bearer {key}"}).raise_for_status()
  print(f"session {session}: grade {grade}")
  return grade


if __name__ == "__main__":
  asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else
                   os.environ.get("PROXY_BASE_URL", "http://127.0.0.1:8000/v1"),
                   os.environ.get("PROXY_API_KEY", "unused")))
