"""Triage recorded traces: `python launch/triage.py --store=runs/traces.db [--out=DIR]`.

Reads every session of the trace store (one tenant's with --tenant), computes per-session
features and failure modes (posttrain_jax/byoh/triage.py states them), writes DIR/triage.md,
DIR/triage.png and the curated session sets DIR/sets/<name>.jsonl (feedback, graded, clean,
mode_<mode>), prints the report and ends with
`RESULT sessions=<n> flagged=<n> feedback=<n>` (flagged: sessions with at least one mode).
Train on a set with `--config.rl.traces.sessions=DIR/sets/feedback.jsonl`. A missing store is
one `error: ...` line and status 1.
"""
import pathlib
import sys

from absl import app, flags

from posttrain_jax.errors import UserError

_STORE = flags.DEFINE_string("store", "runs/traces.db", "The trace store (SQLite file).")
_TENANT = flags.DEFINE_string("tenant", None, "Only this tenant's sessions.")
_OUT = flags.DEFINE_string("out", None, "Report directory (default: <store's folder>/triage).")
_LOW_GRADE = flags.DEFINE_float("low_grade", None, "Grades below this are failures "
                                "(default: TriageConfig's).")


def main(argv):
  if len(argv) > 1:
    raise UserError(f"unexpected argument(s) {argv[1:]}")
  from posttrain_jax.byoh import triage, triage_report
  from posttrain_jax.byoh.store import StoreConfig, StoreError, TraceStore
  store_path = pathlib.Path(_STORE.value)
  if not store_path.is_file():
    raise UserError(f"--store={store_path}: no such file")
  cfg = triage.TriageConfig(**({} if _LOW_GRADE.value is None else
                               {"low_grade": _LOW_GRADE.value}))
  try:
    store = TraceStore(StoreConfig(path=str(store_path)))
  except StoreError as e:
    raise UserError(str(e)) from None
  try:
    features = triage.store_features(store, _TENANT.value, cfg)
  finally:
    store.close()
  out = pathlib.Path(_OUT.value or store_path.parent / "triage")
  paths = triage_report.write_report(features, out, cfg)
  print(triage_report.render_markdown(features, cfg))
  print(f"report: {paths[0]}, {paths[1]}; sets: {out / 'sets'}")
  print(f"RESULT sessions={len(features)} flagged={sum(bool(f.modes) for f in features)} "
        f"feedback={sum(bool(f.feedback) for f in features)}")


if __name__ == "__main__":
  try:
    app.run(main)
  except UserError as e:
    sys.exit(f"error: {e}")
