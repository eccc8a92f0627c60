"""Traces as training samples in one standard form (byoh/samples_jsonl.py), out and back in.

    python launch/export_traces.py --db=runs/traces.db --out=samples.jsonl [--tenant=T]
    python launch/export_traces.py --db=runs/traces.db --import=samples.jsonl

Export: one JSON object per training sample (OpenAI chat form: messages with tool_calls and
tools, plus token_ids, loss_mask, spans, logprobs, versions, grade, feedback, tenant, session).
Import: such a file back into the store as graded sessions to learn from (`rl.mode="traces"`);
a malformed line is one error naming its line and field, and then nothing of the file is stored.
Ends with `RESULT exported=<n>` or `RESULT imported_calls=<n>`.
"""
import pathlib
import sys

from absl import app, flags

from posttrain_jax.errors import UserError

_DB = flags.DEFINE_string("db", "runs/traces.db", "The trace store (SQLite file).")
_OUT = flags.DEFINE_string("out", None, "Export the samples to this JSONL file.")
_IMPORT = flags.DEFINE_string("import", None, "Import the samples of this JSONL file.")
_TENANT = flags.DEFINE_string("tenant", None, "Export only this tenant's sessions.")


def main(argv):
  if len(argv) > 1:
    raise UserError(f"unexpected argument(s) {argv[1:]}")
  if (_OUT.value is None) == (_IMPORT.value is None):
    raise UserError("give one of --out=FILE (export) and --import=FILE")
  from posttrain_jax.byoh.samples_jsonl import export_samples, import_samples
  from posttrain_jax.byoh.store import StoreConfig, StoreError, TraceStore
  if _OUT.value is not None and not pathlib.Path(_DB.value).is_file():
    raise UserError(f"--db={_DB.value}: no such file")
  if _IMPORT.value is not None and not pathlib.Path(_IMPORT.value).is_file():
    raise UserError(f"--import={_IMPORT.value}: no such file")
  try:
    store = TraceStore(StoreConfig(path=_DB.value))
    try:
      if _OUT.value is not None:
        print(f"RESULT exported={export_samples(store, _OUT.value, _TENANT.value)}")
      else:
        print(f"RESULT imported_calls={import_samples(store, _IMPORT.value)}")
    finally:
      store.close()
  except StoreError as e:
    raise UserError(str(e)) from None


if __name__ == "__main__":
  try:
    app.run(main)
  except UserError as e:
    sys.exit(f"error: {e}")
