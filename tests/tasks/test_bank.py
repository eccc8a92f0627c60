"""Task bank: file round trips, deterministic order, exact resume, shards, held-out split, errors."""
import json
import os
import subprocess
import sys

import pytest

from posttrain_jax.tasks import (SOURCES,
    ArithmeticConfig,
    HfDiskSource,
    JsonlSource,
    Task,
    TaskBank,
    TaskBankConfig,
    TaskBankError)

N_ROWS = 40


def _rows():
  rows = [{"id": f"q{i}", "prompt": f"{i}+{i}=", "answer": str(2 * i), "level": i % 3}
          for i in range(N_ROWS)]
  rows[3]["prompt"] = [{"role": "system", "content": "be brief"},
                       {"role": "user", "content": "3+3="}]
  return rows


def _expected(rows):
  return [Task(id=r["id"], prompt=r["prompt"], answer=r["answer"], metadata={"level": r["level"]})
          for r in rows]


def _write_jsonl(path, rows):
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  return str(path)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("tasks")
  rows = _rows()
  _write_jsonl(d / "tasks.jsonl", rows)
  import pyarrow as pa
  import pyarrow.parquet as pq
  # parquet/arrow need one type per column: store the chat prompt of row 3 as its text there
  flat = [dict(r, prompt=r["prompt"] if isinstance(r["prompt"], str) else "3+3=") for r in rows]
  pq.write_table(pa.Table.from_pylist(flat), d / "tasks.parquet")
  try:
    import datasets
  except ImportError:   # optional dependency: only the hf_disk tests skip without it
    return d
  datasets.Dataset.from_list(flat).save_to_disk(str(d / "hf_ds"))
  datasets.DatasetDict({"train": datasets.Dataset.from_list(flat[:30]),
                        "test": datasets.Dataset.from_list(flat[30:])}).save_to_disk(
                            str(d / "hf_dict"))
  return d


def _has_datasets():
  try:
    import datasets  # noqa: F401
    return True
  except ImportError:
    return False


def _need(source):
  if source == "hf_disk":
    pytest.importorskip("datasets")


def _flat_expected():
  rows = _rows()
  rows[3]["prompt"] = "3+3="
  return _expected(rows)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _ids(tasks):
  return [t.id for t in tasks]


# ---------------------------------------------------------------------------------------------
# round trips

@pytest.mark.parametrize("source,path,expected", [
    ("jsonl", "tasks.jsonl", _expected(_rows())),
    ("parquet", "tasks.parquet", _flat_expected()),
    ("hf_disk", "hf_ds", _flat_expected()),
])
def test_round_trip_in_file_order(data_dir, source, path, expected):
  _need(source)
  bank = TaskBank(TaskBankConfig(source=source, path=str(data_dir / path), shuffle=False,
                                 num_epochs=1))
  assert list(bank.iterator()) == expected
  assert list(bank.dataset()) == expected


def test_hf_dataset_dict_split(data_dir):
  _need("hf_disk")
  cfg = TaskBankConfig(source="hf_disk", path=str(data_dir / "hf_dict"), hf_split="test",
                       shuffle=False, num_epochs=1)
  assert list(TaskBank(cfg).iterator()) == _flat_expected()[30:]
  with pytest.raises(TaskBankError, match=r"hf_split to one of \['test', 'train'\]"):
    TaskBank(TaskBankConfig(source="hf_disk", path=str(data_dir / "hf_dict")))


def test_jsonl_random_access_and_fields(tmp_path):
  rows = [{"question": "a", "label": 7, "src": "x"}, {"question": "b", "label": 2.5}]
  path = _write_jsonl(tmp_path / "qa.jsonl", rows)
  src = JsonlSource(path, prompt_field="question", answer_field="label", chat=True)
  assert src[1] == Task(id="qa.jsonl:2", prompt=[{"role": "user", "content": "b"}], answer="2.5")
  assert src[0] == Task(id="qa.jsonl:1", prompt=[{"role": "user", "content": "a"}], answer="7",
                        metadata={"src": "x"})
  assert src[-1] == src[1]
  with pytest.raises(IndexError):
    src[2]


# ---------------------------------------------------------------------------------------------
# order: deterministic by seed, reshuffled per epoch, identical across processes and threads

def test_shuffle_is_deterministic_by_seed(data_dir):
  def order(seed, **kw):
    cfg = TaskBankConfig(source="jsonl", path=str(data_dir / "tasks.jsonl"), seed=seed, **kw)
    return _ids(_take(TaskBank(cfg).iterator(), 2 * N_ROWS))
  a, b, c = order(1), order(1), order(2)
  assert a == b and a != c
  epoch0, epoch1 = a[:N_ROWS], a[N_ROWS:]
  assert sorted(epoch0) == sorted(epoch1) == sorted(f"q{i}" for i in range(N_ROWS))
  assert epoch0 != epoch1 and epoch0 != [f"q{i}" for i in range(N_ROWS)]
  assert order(1, read_threads=4) == a                  # threads change speed, not order


def test_same_order_in_another_process(data_dir):
  code = (
      "import json, sys\n"
      "from posttrain_jax.tasks import TaskBank, TaskBankConfig, ArithmeticConfig\n"
      f"j = TaskBank(TaskBankConfig(source='jsonl', path={str(data_dir / 'tasks.jsonl')!r}, "
      "seed=5)).iterator()\n"
      "s = TaskBank(TaskBankConfig(generator_config=ArithmeticConfig(max_digits=3), seed=5,"
      " eval_fraction=0.1)).iterator()\n"
      "print(json.dumps([[next(j).id for _ in range(60)], [next(s).id for _ in range(60)]]))\n")
  env = dict(os.environ, PYTHONHASHSEED="123")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       check=True, timeout=120)
  other = json.loads(out.stdout.strip().splitlines()[-1])
  j = TaskBank(TaskBankConfig(source="jsonl", path=str(data_dir / "tasks.jsonl"), seed=5))
  s = TaskBank(TaskBankConfig(generator_config=ArithmeticConfig(max_digits=3), seed=5,
                              eval_fraction=0.1))
  assert other == [_ids(_take(j.iterator(), 60)), _ids(_take(s.iterator(), 60))]


# ---------------------------------------------------------------------------------------------
# resume

@pytest.mark.parametrize("cfg_kw,n_before", [
    (dict(source="jsonl", path="tasks.jsonl"), 7),
    (dict(source="jsonl", path="tasks.jsonl"), 37),                       # crosses an epoch
    (dict(source="parquet", path="tasks.parquet", process_index=1, process_count=3), 20),
    (dict(source="hf_disk", path="hf_ds", eval_fraction=0.2), 11),
    (dict(generator_config=ArithmeticConfig(num_operands=3)), 13),       # endless stream
    (dict(synthetic_size=25, num_epochs=3, generator="countdown"), 30),  # sized synthetic
])
def test_resume_equals_uninterrupted(data_dir, cfg_kw, n_before):
  _need(cfg_kw.get("source"))
  if "path" in cfg_kw:
    cfg_kw = dict(cfg_kw, path=str(data_dir / cfg_kw["path"]))
  cfg = TaskBankConfig(seed=11, **cfg_kw)
  n_after = 45
  uninterrupted = _take(TaskBank(cfg).iterator(), n_before + n_after)

  it = TaskBank(cfg).iterator()
  first = _take(it, n_before)
  saved = it.get_state_bytes()
  json.loads(saved)                                                  # plain JSON
  del it
  resumed = TaskBank(cfg).iterator()                                  # a fresh pipeline
  resumed.set_state_bytes(saved)
  assert first + _take(resumed, n_after) == uninterrupted

  via_dict = TaskBank(cfg).iterator()
  via_dict.set_state(json.loads(json.dumps(TaskBank(cfg).iterator().get_state())))
  assert _take(via_dict, 3) == uninterrupted[:3]


def test_finite_run_ends_and_resumes_at_the_end(data_dir):
  cfg = TaskBankConfig(source="jsonl", path=str(data_dir / "tasks.jsonl"), num_epochs=2, seed=3)
  it = TaskBank(cfg).iterator()
  everything = list(it)
  assert len(everything) == 2 * N_ROWS
  again = TaskBank(cfg).iterator()
  again.set_state(it.get_state())
  assert list(again) == []


def test_state_from_another_pipeline_is_refused(data_dir):
  base = dict(source="jsonl", path=str(data_dir / "tasks.jsonl"))
  state = TaskBank(TaskBankConfig(seed=1, **base)).iterator().get_state()
  for other in (TaskBankConfig(seed=2, **base),
                TaskBankConfig(seed=1, process_index=1, process_count=2, **base),
                TaskBankConfig(seed=1, eval_fraction=0.5, **base)):
    with pytest.raises(TaskBankError, match="different task bank"):
      TaskBank(other).iterator().set_state(state)
  with pytest.raises(TaskBankError, match="not valid JSON"):
    TaskBank(TaskBankConfig(seed=1, **base)).iterator().set_state_bytes(b"{nope")


# ---------------------------------------------------------------------------------------------
# shards and held-out split

@pytest.mark.parametrize("count", [2, 3])
def test_shards_are_disjoint_and_cover_everything(data_dir, count):
  shards = []
  for index in range(count):
    cfg = TaskBankConfig(source="jsonl", path=str(data_dir / "tasks.jsonl"), seed=4,
                         num_epochs=1, process_index=index, process_count=count)
    shards.append(_ids(TaskBank(cfg).iterator()))
  all_ids = [i for s in shards for i in s]
  assert len(all_ids) == len(set(all_ids)) == N_ROWS
  even = [len(list(TaskBank(TaskBankConfig(
      source="jsonl", path=str(data_dir / "tasks.jsonl"), num_epochs=1, process_index=i,
      process_count=count, even_shards=True)).iterator())) for i in range(count)]
  assert even == [N_ROWS // count] * count


def test_synthetic_shards_are_disjoint_slices_of_one_stream():
  cfg = dict(generator_config=ArithmeticConfig(max_digits=3), seed=9)
  whole = _take(TaskBank(TaskBankConfig(**cfg)).iterator(), 40)
  s0 = _take(TaskBank(TaskBankConfig(process_index=0, process_count=2, **cfg)).iterator(), 20)
  s1 = _take(TaskBank(TaskBankConfig(process_index=1, process_count=2, **cfg)).iterator(), 20)
  assert s0 == whole[0::2] and s1 == whole[1::2]


def test_held_out_fraction_splits_files(data_dir):
  cfg = TaskBankConfig(source="jsonl", path=str(data_dir / "tasks.jsonl"), eval_fraction=0.3,
                       num_epochs=1)
  bank = TaskBank(cfg)
  train, held = set(_ids(bank.iterator())), set(_ids(bank.eval_tasks()))
  assert train and held and not train & held
  assert train | held == {f"q{i}" for i in range(N_ROWS)}
  # by prompt hash, so the same split whatever the seed or format
  pq_bank = TaskBank(TaskBankConfig(source="parquet", path=str(data_dir / "tasks.parquet"),
                                    eval_fraction=0.3, seed=99))
  assert set(_ids(pq_bank.eval_tasks())) - {"q3"} == held - {"q3"}
  assert len(TaskBank(dataclasses_replace(cfg, eval_size=2)).eval_tasks()) == 2


def test_eval_path(data_dir, tmp_path):
  ev = _write_jsonl(tmp_path / "ev.jsonl", [{"prompt": "9*9=", "answer": 81}])
  bank = TaskBank(TaskBankConfig(source="jsonl", path=str(data_dir / "tasks.jsonl"),
                                 eval_path=ev))
  assert bank.eval_tasks() == [Task(id="ev.jsonl:1", prompt="9*9=", answer="81")]
  with pytest.raises(TaskBankError, match="no held-out split"):
    TaskBank(TaskBankConfig(source="jsonl", path=str(data_dir / "tasks.jsonl"))).eval_tasks()


def test_synthetic_eval_set_is_disjoint_and_seed_independent():
  cfg = TaskBankConfig(generator_config=ArithmeticConfig(max_digits=2), eval_fraction=0.05,
                       eval_size=64, seed=1)
  bank = TaskBank(cfg)
  held = bank.eval_tasks()
  assert len(held) == len(set(_ids(held))) == 64
  assert not set(_ids(_take(bank.iterator(), 3000))) & set(_ids(held))
  assert TaskBank(dataclasses_replace(cfg, seed=2)).eval_tasks() == held
  assert bank.eval_tasks(shard=True) == held
  two = dataclasses_replace(cfg, process_index=1, process_count=2)
  assert TaskBank(two).eval_tasks(shard=True) == held[1::2]


def dataclasses_replace(cfg, **kw):
  import dataclasses
  return dataclasses.replace(cfg, **kw)


# ---------------------------------------------------------------------------------------------
# errors speak to the user

def test_malformed_jsonl_names_file_and_lines(tmp_path):
  lines = ['{"prompt": "1+1=", "answer": "2"}',
           '{"prompt": "2+2=", "answer": "4"',                 # line 2: not JSON
           '',
           '{"prompt": "3+3="}',                               # line 4: no answer
           '{"prompt": 5, "answer": "1"}',                     # line 5: bad prompt type
           '{"prompt": "x", "answer": null}',                  # line 6: null answer
           '[1, 2]']                                            # line 7: not an object
  path = tmp_path / "broken.jsonl"
  path.write_text("\n".join(lines) + "\n")
  with pytest.raises(TaskBankError) as e:
    TaskBank(TaskBankConfig(source="jsonl", path=str(path)))
  msg = str(e.value)
  assert "5 malformed line(s), nothing loaded" in msg
  assert f"{path}:2: not valid JSON" in msg
  assert f"{path}:4: missing field 'answer'" in msg and "answer_field" in msg
  assert f"{path}:5: prompt must be a string or a non-empty list" in msg
  assert f"{path}:6: field 'answer' is null" in msg
  assert f"{path}:7: expected a JSON object" in msg
  assert f"{path}:1" not in msg and f"{path}:3" not in msg


def test_many_bad_lines_are_summarised(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text("nope\n" * 12)
  with pytest.raises(TaskBankError, match=r"(?s)12 malformed line\(s\).*and 7 more"):
    JsonlSource(str(path))


def test_other_load_errors(tmp_path, data_dir):
  with pytest.raises(FileNotFoundError, match="missing.jsonl"):
    TaskBank(TaskBankConfig(source="jsonl", path=str(tmp_path / "missing.jsonl")))
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n\n")
  with pytest.raises(TaskBankError, match="contains no tasks"):
    JsonlSource(str(empty))
  dup = _write_jsonl(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "p", "answer": "1"},
                                              {"id": "a", "prompt": "q", "answer": "2"}])
  with pytest.raises(TaskBankError, match=r"dup.jsonl:2: duplicate id 'a' \(first seen at .*dup.jsonl:1\)"):
    JsonlSource(dup)
  with pytest.raises(TaskBankError, match=r"missing column\(s\) \['question'\]"):
    TaskBank(TaskBankConfig(source="parquet", path=str(data_dir / "tasks.parquet"),
                            prompt_field="question"))
  if _has_datasets():
    with pytest.raises(TaskBankError, match="not a dataset written by save_to_disk"):
      HfDiskSource(str(tmp_path))
  else:
    with pytest.raises(TaskBankError, match="pip install datasets"):
      HfDiskSource(str(tmp_path))
  with pytest.raises(TaskBankError, match="holds out every"):
    TaskBank(TaskBankConfig(source="jsonl", path=dup, eval_fraction=0.999999, id_field="x"))


def test_config_errors_name_the_field():
  with pytest.raises(TaskBankError, match="registered sources: .*hf_disk, .*jsonl, parquet, "
                                         ".*synthetic"):
    TaskBankConfig(source="csv", path="x.csv")
  assert {"hf_disk", "jsonl", "parquet", "synthetic"} <= set(SOURCES.names())   # and any added
  with pytest.raises(TaskBankError, match="do not apply to source 'synthetic': it reads no file"):
    TaskBankConfig(path="x.jsonl")
  for kw, field in [(dict(source="jsonl"), "path"), (dict(eval_fraction=1.0), "eval_fraction"),
                    (dict(process_index=2, process_count=2), "process_index"),
                    (dict(seed=-1), "seed"), (dict(num_epochs=2), "synthetic_size"),
                    (dict(synthetic_size=5, num_epochs=0), "num_epochs")]:
    with pytest.raises(TaskBankError, match=field):
      TaskBankConfig(**kw)
