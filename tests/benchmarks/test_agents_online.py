"""benchmarks/agents_online.py's calculator tool: what a harness author would trust with text a
model wrote (the smoke run of the whole benchmark is test_smoke.py's)."""
import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("agents_online", ROOT / "benchmarks" / "agents_online.py")
bench = importlib.util.module_from_spec(spec)
sys.modules["agents_online"] = bench   # its dataclasses look their module up
spec.loader.exec_module(bench)


@pytest.mark.parametrize("expression,value", [
    ("gcd(12, 18)", "6"), ("gcd(84, 36)", "12"), ("lcm(4, 6)", "12"), ("2 ** 10 - 1", "1023"),
    ("(7 + 5) // 5", "2"), ("-3 * -4", "12"), ("17 % 5", "2"), ("max(3, 9, 4)", "9"),
    (" 1 / 4 ", "0.25")])
def test_it_computes(expression, value):
  assert bench.calculate(expression) == value


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "open('/etc/passwd').read()", "gcd.__class__",
    "(lambda: 1)()", "2 ** 100000", "1 / 0", "gcd(1, 2", "x + 1", "'a' * 3", "gcd(a=1, b=2)"])
def test_anything_else_is_an_error_the_model_reads(expression):
  assert bench.calculate(expression).startswith("error: ")
