"""Final-answer extraction shared by the graders: the last `\\boxed{}`, GSM8K's `####`, "the
answer is", the last (or first) number; numbers normalised and parsed as exact fractions."""
from __future__ import annotations

import fractions
import re
from typing import Optional


Fraction = fractions.Fraction


# ----------------------------------------------------------------------------------------------
# Final-answer extraction.

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")


def last_boxed(text: str) -> Optional[str]:
  r"""Content of the last `\boxed{...}` / `\fbox{...}` (nested braces matched), or None.

  `\boxed 5` (no braces) yields "5". An unclosed brace yields None for that box.
  """
  found = None
  for m in _BOXED_RE.finditer(text):
    i = m.end()
    if i < len(text) and text[i] == "{":
      depth, j = 0, i
      while j < len(text):
        if text[j] == "{":
          depth += 1
        elif text[j] == "}":
          depth -= 1
          if depth == 0:
            found = text[i + 1:j]
            break
        j += 1
    else:
      tok = re.match(r"[^\s$]+", text[i:])
      if tok:
        found = tok.group(0)
  return found


_HASHES_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*", re.IGNORECASE)

# A number: optional sign (not when it reads as a binary minus after a digit or bracket),
# digits with optional thousands commas, optional decimals, optional "/denominator".
_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_NUMBER_RE = re.compile(
    rf"(?<![\w.)\]}}])[-+]?(?:{_NUM})(?:\s*/\s*(?:{_NUM}))?|(?:{_NUM})(?:\s*/\s*(?:{_NUM}))?")
_FRAC_RE = re.compile(r"([-+]?)\s*\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")


def _latex_fracs_to_slash(s: str) -> str:
  return _FRAC_RE.sub(lambda m: f"{m.group(1)}({m.group(2)})/({m.group(3)})", s)


def _numbers_in(text: str) -> list[str]:
  text = _latex_fracs_to_slash(text)
  text = re.sub(r"\(\s*([-+]?[\d.,]+)\s*\)", r"\1", text)  # "(1)/(2)" -> "1/2"
  return [m.group(0) for m in _NUMBER_RE.finditer(text)]


def extract_final_answer(text: str, pick: str = "last") -> tuple[Optional[str], str]:
  r"""`(answer_text, how)`: the final answer of a completion and which rule found it.

  `how` is one of "boxed", "####", "answer_is", "last_number", "none"; `pick` ("last" |
  "first") is which number of the text rule 4 reads (its `how` is "last_number" either way).
  """
  boxed = last_boxed(text)
  if boxed is not None:
    return boxed.strip(), "boxed"
  hashes = _HASHES_RE.findall(text)
  if hashes:
    return hashes[-1].strip(), "####"
  matches = list(_ANSWER_IS_RE.finditer(text))
  if matches:
    nums = _numbers_in(text[matches[-1].end():].split("\n")[0])
    if nums:
      return nums[0].strip(), "answer_is"
  nums = _numbers_in(text)
  if nums:
    return nums[0 if pick == "first" else -1].strip(), "last_number"
  return None, "none"


def parse_number(s: str) -> Optional[Fraction]:
  r"""The value of an extracted answer string as an exact Fraction, or None if not a number.

  Accepts "1,234", "+5", "-3.50", ".5", "7.", "3/4", "-\frac{1}{2}", "\dfrac{3}{4}", "$12",
  "50\%", "12 \text{ cm}", "x = 5", "5^\circ".
  """
  s = s.strip()
  s = re.sub(r"\\text\s*\{[^{}]*\}|\\(?:mathrm|mbox)\s*\{[^{}]*\}", " ", s)
  s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
  s = s.replace("\\!", "").replace("\\,", "").replace("^\\circ", "").replace("^{\\circ}", "")
  s = s.replace("\\left", "").replace("\\right", "")
  if "=" in s:
    s = s.rsplit("=", 1)[1]
  s = _latex_fracs_to_slash(s).replace("{", "(").replace("}", ")")
  s = s.replace(" ", "").rstrip(".")
  s = re.sub(r"\(([-+]?[\d.,]+)\)", r"\1", s)
  m = re.fullmatch(rf"([-+]?)\(?([-+]?)({_NUM})\)?(?:/\(?({_NUM})\)?)?", s)
  if not m:
    return None
  sign = -1 if (m.group(1) == "-") != (m.group(2) == "-") else 1
  try:
    value = Fraction(m.group(3).replace(",", ""))
    if m.group(4) is not None:
      den = Fraction(m.group(4).replace(",", ""))
      if den == 0:
        return None
      value /= den
  except (ValueError, ZeroDivisionError):
    return None
  return sign * value


def _format_number(x: Fraction) -> str:
  return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


# ----------------------------------------------------------------------------------------------
# numeric

