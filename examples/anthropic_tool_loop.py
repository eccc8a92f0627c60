"""The Anthropic SDK's tool-use loop (tool_use -> tool_result) on the proxy's Messages API, graded.

    python launch/serve.py                                # in one shell
    python examples/anthropic_tool_loop.py [BASE_URL]     # in another

`anthropic.Anthropic` posts to `/v1/messages` (the key as `x-api-key`). The model is
asked for the area of a 3 x 4 room and then, in a second user turn, of a 5 x 6 one; each
`tool_use` block is run and answered with a `tool_result`, the assistant content sent back as
the client got it, until the model ends its turn. Every call carries the session id as
`X-Session-Id`; at the end the last answer is graded (1 if it says 30, else 0) and posted to
`/v1/sessions/{id}/feedback`. BASE_URL defaults to $PROXY_BASE_URL or
http://127.0.0.1:8000/v1 (the same URL as the OpenAI examples; the SDK adds /v1 itself, so it is
cut here), the key to $PROXY_API_KEY or "unused" (launch/serve.py without
--config.api_keys_file takes any key).
"""
import os
import sys
import uuid

import anthropic
import httpx

TOOLS = [{"name": "area", "description": "The area of a width x length rectangle.",
          "input_schema": {"type": "object", "required": ["width", "length"], "properties": {
              "width": {"type": "number"}, "length": {"type": "number"}}}}]


def run_tool(name: str, args: dict) -> str:
  """The tool's result, or the error the model reads instead (a model may call it wrong)."""
  if name != "area":
    return f"error: no tool {name!r}"
  try:
    return str(args["width"] * args["length"])
  except (KeyError, TypeError) as e:
    return f"error: {e!r}"


def turn(client: anthropic.Anthropic, messages: list) -> str:
  """Calls the model until it ends its turn, answering each tool_use; returns its last text."""
  for _ in range(6):
    reply = client.messages.create(model="posttrain_jax", max_tokens=256, tools=TOOLS,
                                   system="Use the area tool.", messages=messages)
    messages.append({"role": "assistant", "content": reply.content})
    uses = [b for b in reply.content if b.type == "tool_use"]
    if reply.stop_reason != "tool_use" or not uses:
      return "".join(b.text for b in reply.content if b.type == "text")
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": u.id, "content": run_tool(u.name, u.input)}
        for u in uses]})
  return ""


def main(base_url: str, key: str) -> float:
  base_url = base_url.rstrip("/").removesuffix("/v1")
  session = f"anthropic-{uuid.uuid4().hex[:8]}"
  client = anthropic.Anthropic(base_url=base_url, api_key=key,
                               default_headers={"X-Session-Id": session})
  messages = [{"role": "user", "content": "What is the area of a 3 by 4 room?"}]
  print("turn 1:", turn(client, messages))
  messages.append({"role": "user", "content": "And of a 5 by 6 room?"})
  answer = turn(client, messages)
  print("turn 2:", answer)
  grade = float("30" in answer)
  httpx.post(f"{base_url}/v1/sessions/{session}/feedback", json={"grade": grade},
             headers={"x-api-key": key}).raise_for_status()
  print(f"session {session}: grade {grade}")
  return grade


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else
       os.environ.get("PROXY_BASE_URL", "http://127.0.0.1:8000/v1"),
       os.environ.get("PROXY_API_KEY", "unused"))
