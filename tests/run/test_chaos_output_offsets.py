"""The chaos drills read each restart's own stdout from a shared .out file by its byte size
before the restart; a log line with a non-ASCII character ("≥") once made that slice start two
characters late, so "resumed from ... (step 10)" read as "sumed from" and a resumed trial
(benchmarks/chaos_resume.py trial 12 of 2026-12-06) was counted as failed."""
from tests.support import chaos as ct


def test_a_restart_reads_its_own_output_after_non_ascii_text(tmp_path):
  out = tmp_path / "trial.out"
  out.write_text("async bound ≥ 0.66 × step\n", encoding="utf-8")
  before = ct._size(out)
  with out.open("a", encoding="utf-8") as f:
    f.write("resumed from /runs/trial/checkpoints/10 (step 10)\n")
  assert ct.resumed_from(ct.since(out, before)) == 10
  assert ct.resumed_from(out.read_text(encoding="utf-8")[before:]) is None   # the old slice
