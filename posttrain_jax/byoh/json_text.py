"""JSON text from outside (a request body, a line of an export) read into Python, or one reason
why not.

`json.loads` alone lets three things through that break later, far from the input: a lone
surrogate escape (`"\\ud800"` decodes to a str that SQLite and tokenizers cannot encode), nesting
deep enough to exhaust the recursion limit, and integers past Python's 4300-digit limit (a
ValueError that is not a JSONDecodeError). `loads` turns each into a `JsonTextError` that says
what is wrong and, for a surrogate, in which field.
"""
from __future__ import annotations

import json
from typing import Any, Optional


class JsonTextError(ValueError):
  """Text that is not usable JSON; `field` names the top-level key at fault, if one is."""

  def __init__(self, message: str, field: Optional[str] = None):
    super().__init__(message)
    self.field = field


def _has_surrogate(value: Any) -> bool:
  try:
    json.dumps(value, ensure_ascii=False).encode("utf-8")
  except UnicodeEncodeError:
    return True
  return False


def loads(raw: bytes | str) -> Any:
  """The JSON value of `raw` (UTF-8 bytes or text); JsonTextError otherwise."""
  try:
    text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
  except UnicodeDecodeError as e:
    raise JsonTextError(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise JsonTextError(f"not JSON ({e.msg} at column {e.colno})") from None
  except RecursionError:
    raise JsonTextError("not JSON we read: nested too deeply") from None
  except ValueError as e:  # Python refuses to read integers of more than 4300 digits
    raise JsonTextError(f"not JSON we read ({str(e).split(';')[0]})") from None
  if _has_surrogate(value):
    where, field = "", None
    if isinstance(value, dict):
      key = next((k for k, v in value.items() if _has_surrogate(k) or _has_surrogate(v)))
      where, field = (" in a field name", None) if _has_surrogate(key) else (
          f" in field {key!r}", key)
    raise JsonTextError(f"a lone surrogate escape (\\ud800-\\udfff){where} is not text", field)
  return value
