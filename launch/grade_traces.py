"""Grade stored sessions: `python launch/grade_traces.py --store=runs/traces.db --grader=reference`.

Runs a registered trace grader (posttrain_jax/byoh/grading.py) over the store's sessions (one
tenant's with --tenant) and stores each verdict as feedback ("grader:<name>"); sessions it has
graded before are skipped unless --regrade. Ends with
`RESULT graded=<n> ungradable=<n> skipped=<n>`.
"""
import pathlib
import sys

from absl import app, flags

from posttrain_jax.errors import UserError

_STORE = flags.DEFINE_string("store", "runs/traces.db", "The trace store (SQLite file).")
_GRADER = flags.DEFINE_string("grader", "reference", "A registered trace grader.")
_TENANT = flags.DEFINE_string("tenant", None, "Only this tenant's sessions.")
_REGRADE = flags.DEFINE_bool("regrade", False, "Grade again sessions that grew since.")


def main(argv):
  if len(argv) > 1:
    raise UserError(f"unexpected argument(s) {argv[1:]}")
  from posttrain_jax.byoh.grading import TRACE_GRADERS, grade_sessions
  from posttrain_jax.byoh.store import StoreConfig, StoreError, TraceStore
  if not pathlib.Path(_STORE.value).is_file():
    raise UserError(f"--store={_STORE.value}: no such file")
  if _GRADER.value not in TRACE_GRADERS.names():
    raise UserError(f"--grader={_GRADER.value}: valid: {TRACE_GRADERS.names()}")
  try:
    store = TraceStore(StoreConfig(path=_STORE.value))
  except StoreError as e:
    raise UserError(str(e)) from None
  counts = grade_sessions(store, _GRADER.value, tenant=_TENANT.value, regrade=_REGRADE.value)
  store.close()
  print(f"RESULT graded={counts['graded']} ungradable={counts['ungradable']} "
        f"skipped={counts['skipped']}")


if __name__ == "__main__":
  try:
    app.run(main)
  except UserError as e:
    sys.exit(f"error: {e}")
