"""Audit a run for reward hacking: `python launch/audit.py --workdir RUN_DIR [--out DIR]`.

Reads RUN_DIR/metrics.jsonl, compares the first and last quarter of each signal
(posttrain_jax/audit.py states the rules), writes DIR/audit.md and DIR/audit.png (default DIR:
RUN_DIR/audit/), prints the report and ends with one line `RESULT flags=<n> signals=<n>`.

Exit status: 0 whether or not flags are found (a flag is a finding for a person to read, not an
error); with `--fail_on_flags` (for CI) 2 when at least one flag is raised. A missing workdir
or metrics file, or a malformed line, is one `error: ...` line and status 1, no traceback.
"""
import pathlib
import sys

from absl import app, flags

from posttrain_jax.errors import PathNotFoundError, UserError

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory holding metrics.jsonl.")
_OUT = flags.DEFINE_string("out", None, "Report directory (default: <workdir>/audit).")
_MIN_STEPS = flags.DEFINE_integer("min_steps", None,
                                  "Logged steps needed before any flag (default: AuditConfig's).")
_FAIL_ON_FLAGS = flags.DEFINE_bool("fail_on_flags", False,
                                   "Exit with status 2 if any flag is raised (for CI).")
FLAGGED_STATUS = 2


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    raise UserError(f"{e} (--helpfull lists the flags)") from None


def main(argv):
  if len(argv) > 1:
    raise UserError(f"unexpected argument(s) {argv[1:]}; use --workdir=RUN_DIR")
  if not _WORKDIR.value:
    raise UserError("--workdir is required: the run directory holding metrics.jsonl")
  from posttrain_jax import audit

  workdir = pathlib.Path(_WORKDIR.value)
  if not workdir.is_dir():
    raise PathNotFoundError(f"--workdir={workdir}: no such directory")
  overrides = {} if _MIN_STEPS.value is None else {"min_steps": _MIN_STEPS.value}
  cfg = audit.AuditConfig(**overrides)
  rows = audit.load_metrics(workdir / "metrics.jsonl")
  report = audit.audit(rows, cfg)
  paths = audit.write_report(report, rows, pathlib.Path(_OUT.value or workdir / "audit"))
  print(audit.render_markdown(report))
  print("report: " + ", ".join(str(p) for p in paths))
  print(audit.result_line(report))
  if _FAIL_ON_FLAGS.value and report.flags:
    sys.exit(FLAGGED_STATUS)


if __name__ == "__main__":
  try:
    app.run(main, flags_parser=_parse_flags)
  except UserError as e:
    sys.exit(f"error: {e}")
