"""The trace store: every call the proxy served, append-only, in SQLite (WAL mode).

Why SQLite: one file, no server to run beside the proxy, transactions that survive `kill -9`
(the write-ahead log is replayed on the next open), and the queries we need (by tenant, session,
time, status) are plain indexed SQL. One process writes (the proxy); trainers and exports read
concurrently, which WAL allows without blocking the writer.

Nothing is ever updated or deleted. A call is two rows, written at two moments:

    calls     inserted when the request is accepted (request, rendered prompt and its ids, the
              session, where its prompt continues an earlier call: parent call and choice, or
              the reason it does not)
    results   inserted when the call ends: status "complete" (the response reached the client),
              "incomplete" (the client went away, the stream was cut), "error" (our engine
              failed) or "rejected" (samples the proxy drew but did not answer with: they missed
              the request's tool_choice, see tool_choice.py), with per choice the sampled
              ids, their log-probs, finish reason and policy version, and the latency

A call with no results row was cut by the proxy dying: it reads as "incomplete". Only
"complete" calls are ever trained on. Feedback rows (grades, rubrics, free text) attach to a
session or one call at any later time, keyed for idempotency.

Prompt ids are stored as a little-endian int32 blob (exact, ~4× smaller than JSON); each choice's
sampled ids and log-probs as JSON (Python's float repr round-trips exactly). `export_jsonl` /
`import_jsonl` carry everything as JSON lines with a schema version.

Disk faults. A write that fails because of the disk (SQLite's "database or disk is full",
a read-only file or file system, an I/O error) raises `StoreWriteError` naming the store's
path and the cause. Each write is one SQLite transaction, so it is stored whole or not at
all: what was stored before stays intact and readable, and a call whose `end_call` failed
reads as incomplete (never trained on). An `export_jsonl` that fails leaves no file behind
and its destination as it was.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import pathlib
import sqlite3
import threading
import time
from typing import Any, Iterable, Iterator, Optional

import numpy as np

from posttrain_jax.byoh.records import (CALL_STATUSES, SCHEMA_VERSION, CallRecord, Choice,
                                        Feedback, StoreError, parse_record)
from posttrain_jax.errors import DiskWriteError, disk_cause, disk_errno, disk_fix, free_note


_SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
  id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session TEXT NOT NULL, created REAL NOT NULL,
  kind TEXT NOT NULL, request TEXT NOT NULL, messages TEXT, tools TEXT,
  prompt_text TEXT NOT NULL, prompt_ids BLOB NOT NULL,
  parent_call TEXT, parent_choice INTEGER, break_reason TEXT);
CREATE INDEX IF NOT EXISTS calls_session ON calls (tenant, session, created);
CREATE INDEX IF NOT EXISTS calls_time ON calls (tenant, created);
CREATE TABLE IF NOT EXISTS results (
  call_id TEXT PRIMARY KEY REFERENCES calls (id), finished REAL NOT NULL, status TEXT NOT NULL,
  reason TEXT, response TEXT, choices TEXT NOT NULL, latency_s REAL);
CREATE TABLE IF NOT EXISTS feedback (
  id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session TEXT NOT NULL, call_id TEXT,
  created REAL NOT NULL, grade REAL, rubric TEXT, text TEXT, source TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS feedback_session ON feedback (tenant, session, created);
CREATE TABLE IF NOT EXISTS session_keys (
  key TEXT PRIMARY KEY, tenant TEXT NOT NULL, session TEXT NOT NULL, created REAL NOT NULL);
"""


class StoreWriteError(DiskWriteError, StoreError):
  """The disk refused a write (full, read-only, I/O error); nothing of that write was stored."""


# SQLite's primary result codes that are the disk's state -> errno
_SQLITE_DISK = {"SQLITE_FULL": errno.ENOSPC, "SQLITE_READONLY": errno.EROFS,
                "SQLITE_IOERR": errno.EIO, "SQLITE_CANTOPEN": errno.EACCES}


def _disk_fault(e: BaseException, path: pathlib.Path, what: str,
                kept: str = "nothing of it was stored; what was stored before is intact"
                ) -> Optional[StoreWriteError]:
  """`e` as a StoreWriteError naming `path`, `what` failed and what was `kept`, if it is a disk
  fault (else None)."""
  code = None
  if isinstance(e, sqlite3.Error):
    name = getattr(e, "sqlite_errorname", "") or ""
    code = next((c for k, c in _SQLITE_DISK.items() if name.startswith(k)), None)
    if code is None and "disk is full" in str(e):
      code = errno.ENOSPC
  code = code or disk_errno(e)
  if code is None:
    return None
  if code in (errno.EACCES, errno.EROFS):  # SQLite says "cannot open" / "readonly" for both
    code = errno.EROFS if _read_only_fs(path.parent) else errno.EACCES
  return StoreWriteError(
      f"trace store {path}: {what} failed: {disk_cause(code)} ({e}){free_note(code, path.parent)}"
      f"; {kept}; {disk_fix(code, path.parent)}", code)


def _read_only_fs(d: pathlib.Path) -> bool:
  try:
    return bool(os.statvfs(d).f_flag & os.ST_RDONLY)
  except OSError:
    return False


def _ids_blob(ids: Iterable[int]) -> bytes:
  return np.asarray(list(ids), "<i4").tobytes()


def _ids(blob: bytes) -> list[int]:
  return np.frombuffer(blob, "<i4").tolist()


@dataclasses.dataclass(frozen=True)
class StoreConfig:
  """Where the trace store lives and how hard it syncs."""
  path: str = "runs/traces.db"    # the SQLite file (created with its folder)
  synchronous: str = "FULL"       # SQLite PRAGMA synchronous: FULL survives power loss, NORMAL
                                  # only process crashes (kill -9), at less latency per call
  busy_timeout_ms: int = 5000     # how long a reader waits on the writer's lock


class TraceStore:
  """The append-only store (module docstring). Thread-safe: one connection behind a lock."""

  def __init__(self, cfg: StoreConfig = StoreConfig()):
    if cfg.synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
      raise StoreError(f"StoreConfig.synchronous={cfg.synchronous!r}; valid: NORMAL, FULL, EXTRA")
    self.cfg = cfg
    path = self.path = pathlib.Path(cfg.path)
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None,
                                 timeout=cfg.busy_timeout_ms / 1000)
      self._db.execute("PRAGMA journal_mode=WAL")
      self._db.execute(f"PRAGMA synchronous={cfg.synchronous.upper()}")
      version = self._db.execute("PRAGMA user_version").fetchone()[0]
      if version not in (0, SCHEMA_VERSION):
        raise StoreError(f"{path}: trace store schema version {version}; this code reads "
                         f"{SCHEMA_VERSION}")
      if version == 0:  # a new store (an existing one is opened without a write: readable
        self._db.executescript(_SCHEMA)  # on a full disk)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except (sqlite3.DatabaseError, OSError) as e:
      fault = _disk_fault(e, path, "opening", "the store was not opened")
      if fault is not None:
        raise fault from e
      raise StoreError(f"{path}: cannot open the trace store ({e})") from e
    self._lock = threading.Lock()

  def close(self) -> None:
    with self._lock:
      self._db.close()

  def _write(self, sql: str, args: tuple, what: str = "a write") -> int:
    """Runs one INSERT (its own transaction); the number of rows it stored."""
    with self._lock:
      try:
        return self._db.execute(sql, args).rowcount
      except sqlite3.IntegrityError as e:
        raise StoreError(f"trace store: {e}") from e
      except sqlite3.Error as e:
        fault = _disk_fault(e, self.path, what)
        if fault is not None:
          raise fault from e
        raise

  # -- writing --------------------------------------------------------------------------------

  def begin_call(self, *, call_id: str, tenant: str, session: str, kind: str,
                 request: dict[str, Any], prompt_text: str, prompt_ids: list[int],
                 messages: Optional[list] = None, tools: Optional[list] = None,
                 parent_call: Optional[str] = None, parent_choice: Optional[int] = None,
                 break_reason: Optional[str] = None, created: Optional[float] = None) -> None:
    """Records an accepted call before it is served (it reads as incomplete until `end_call`)."""
    self._write(
        "INSERT INTO calls VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (call_id, tenant, session, time.time() if created is None else created, kind,
         json.dumps(request), None if messages is None else json.dumps(messages),
         None if tools is None else json.dumps(tools), prompt_text, _ids_blob(prompt_ids),
         parent_call, parent_choice, break_reason), f"recording call {call_id}")

  def end_call(self, call_id: str, *, status: str, choices: list[Choice] = (),
               response: Optional[dict] = None, reason: Optional[str] = None,
               latency_s: Optional[float] = None, finished: Optional[float] = None) -> None:
    """Records how a call ended (once; a second end of the same call is refused)."""
    if status not in CALL_STATUSES:
      raise StoreError(f"call status {status!r}; valid: {CALL_STATUSES}")
    for c in choices:
      if len(c.token_ids) != len(c.logprobs):
        raise StoreError(f"call {call_id} choice {c.index}: {len(c.token_ids)} ids but "
                         f"{len(c.logprobs)} log-probs")
    self._write("INSERT INTO results VALUES (?,?,?,?,?,?,?)",
                (call_id, time.time() if finished is None else finished, status, reason,
                 None if response is None else json.dumps(response),
                 json.dumps([c.to_json() for c in choices]), latency_s),
                f"recording the end of call {call_id}")

  def add_feedback(self, fb: Feedback) -> bool:
    """Stores `fb` unless a feedback with its id exists (idempotent); True if it was new."""
    return self._write(
        "INSERT OR IGNORE INTO feedback VALUES (?,?,?,?,?,?,?,?,?)",
        (fb.id, fb.tenant, fb.session, fb.call_id, fb.created, fb.grade,
         None if fb.rubric is None else json.dumps(fb.rubric), fb.text, fb.source),
        f"recording feedback {fb.id}") == 1

  def add_session_key(self, key: str, tenant: str, session: str) -> None:
    self._write("INSERT INTO session_keys VALUES (?,?,?,?)", (key, tenant, session, time.time()),
                f"recording a key of session {session}")

  # -- reading --------------------------------------------------------------------------------

  def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
    with self._lock:
      return self._db.execute(sql, args).fetchall()

  def session_key(self, key: str) -> Optional[tuple[str, str]]:
    """(tenant, session) of a per-session API key, or None."""
    rows = self._query("SELECT tenant, session FROM session_keys WHERE key=?", (key,))
    return rows[0] if rows else None

  _SELECT = ("SELECT c.*, r.finished, r.status, r.reason, r.response, r.choices, r.latency_s "
             "FROM calls c LEFT JOIN results r ON r.call_id = c.id")

  @staticmethod
  def _record(row: tuple) -> CallRecord:
    (cid, tenant, session, created, kind, request, messages, tools, prompt_text, prompt_ids,
     parent_call, parent_choice, break_reason, finished, status, reason, response, choices,
     latency) = row
    return CallRecord(
        id=cid, tenant=tenant, session=session, created=created, kind=kind,
        request=json.loads(request), messages=None if messages is None else json.loads(messages),
        tools=None if tools is None else json.loads(tools), prompt_text=prompt_text,
        prompt_ids=_ids(prompt_ids), parent_call=parent_call, parent_choice=parent_choice,
        break_reason=break_reason, status=status or "incomplete",
        reason=reason if status else "no result recorded (the proxy stopped mid-call)",
        finished=finished, response=None if response is None else json.loads(response),
        choices=[Choice(**c) for c in json.loads(choices)] if choices else [],
        latency_s=latency)

  def call(self, call_id: str, tenant: Optional[str] = None) -> Optional[CallRecord]:
    """One call (only if it belongs to `tenant`, when given)."""
    sql, args = self._SELECT + " WHERE c.id=?", (call_id,)
    if tenant is not None:
      sql, args = sql + " AND c.tenant=?", (call_id, tenant)
    rows = self._query(sql, args)
    return self._record(rows[0]) if rows else None

  def calls(self, tenant: str, session: Optional[str] = None, *, status: Optional[str] = None,
            since: Optional[float] = None, until: Optional[float] = None) -> list[CallRecord]:
    """A tenant's calls (of one session, a status, a time range), oldest first."""
    where, args = ["c.tenant=?"], [tenant]
    if session is not None:
      where.append("c.session=?")
      args.append(session)
    if since is not None:
      where.append("c.created>=?")
      args.append(since)
    if until is not None:
      where.append("c.created<?")
      args.append(until)
    rows = self._query(self._SELECT + " WHERE " + " AND ".join(where) +
                       " ORDER BY c.created, c.rowid", tuple(args))
    out = [self._record(r) for r in rows]
    return [c for c in out if c.status == status] if status else out

  def sessions(self, tenant: str, *, since: Optional[float] = None) -> list[dict[str, Any]]:
    """A tenant's sessions: id, first / last call time, number of calls, newest first."""
    rows = self._query(
        "SELECT session, MIN(created), MAX(created), COUNT(*) FROM calls WHERE tenant=? "
        "AND created>=? GROUP BY session ORDER BY MAX(created) DESC",
        (tenant, -1.0 if since is None else since))
    return [{"id": s, "first_call": a, "last_call": b, "calls": n} for s, a, b, n in rows]

  def has_session(self, tenant: str, session: str) -> bool:
    return bool(self._query("SELECT 1 FROM calls WHERE tenant=? AND session=? LIMIT 1",
                            (tenant, session)) or
                self._query("SELECT 1 FROM session_keys WHERE tenant=? AND session=? LIMIT 1",
                            (tenant, session)))

  def feedback(self, tenant: str, session: Optional[str] = None) -> list[Feedback]:
    """A tenant's feedback (of one session), oldest first."""
    sql, args = "SELECT * FROM feedback WHERE tenant=?", [tenant]
    if session is not None:
      sql, args = sql + " AND session=?", args + [session]
    rows = self._query(sql + " ORDER BY created, rowid", tuple(args))
    return [Feedback(i, t, s, c, cr, g, None if r is None else json.loads(r), x, src)
            for i, t, s, c, cr, g, r, x, src in rows]

  def tenants(self) -> list[str]:
    return [r[0] for r in self._query("SELECT DISTINCT tenant FROM calls ORDER BY tenant")]

  # -- export / import ------------------------------------------------------------------------

  def export_jsonl(self, path: str, tenant: Optional[str] = None) -> int:
    """Writes every call and feedback (of `tenant`, or all) as JSON lines; returns the count.
    The file is written beside its destination and renamed, so a failed export leaves no
    half-written file."""
    out = pathlib.Path(path)
    tmp = out.with_name(out.name + ".tmp")
    n = 0
    try:
      with open(tmp, "w") as f:
        for t in ([tenant] if tenant else self.tenants()):
          for c in self.calls(t):
            f.write(json.dumps({"schema_version": SCHEMA_VERSION, "type": "call", **c.to_json()})
                    + "\n")
            n += 1
          for fb in self.feedback(t):
            f.write(json.dumps({"schema_version": SCHEMA_VERSION, "type": "feedback",
                                **dataclasses.asdict(fb)}) + "\n")
            n += 1
        f.flush()
        os.fsync(f.fileno())
      tmp.replace(out)
    except BaseException as e:
      try:
        tmp.unlink(missing_ok=True)
      except OSError:  # a read-only directory refuses even this (EROFS): no tmp was made there
        pass
      code = disk_errno(e) if isinstance(e, Exception) else None
      if code is None:
        raise
      raise StoreWriteError(f"trace export to {out} failed: {disk_cause(code)}"
                            f"{free_note(code, out.parent)}; {out} is as it was; "
                            f"{disk_fix(code, out.parent)}", code) from e
    return n

  def import_jsonl(self, path: str) -> tuple[int, list[str]]:
    """Reads an export: every valid record is stored, in one transaction; returns (stored,
    errors), each error naming its line and field. Records already present are skipped.
    Lines are split at "\\n" only (the numbering of `sed -n` and editors), read as bytes, so
    a line that is not UTF-8 is one error, not the end of the import."""
    records, errors = [], []
    with open(path, "rb") as f:
      for lineno, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          records.append(parse_record(line))
        except StoreError as e:
          errors.append(f"{path}:{lineno}: {e}")
    return self.insert_records(records, path), errors

  def insert_records(self, records: list[tuple[str, dict]], what: str = "records") -> int:
    """Stores validated ("call" | "feedback", record) pairs, all in one transaction (all or
    nothing); records already present are skipped. Returns how many were stored."""
    stored = 0
    with self._lock:
      try:
        self._db.execute("BEGIN IMMEDIATE")
        try:
          for kind, rec in records:
            stored += self._insert_imported(kind, rec)
          self._db.execute("COMMIT")
        except BaseException:
          if self._db.in_transaction:  # SQLite may have rolled back a failed COMMIT itself
            self._db.execute("ROLLBACK")
          raise
      except sqlite3.Error as e:
        fault = _disk_fault(e, self.path, f"importing {what}")
        if fault is not None:
          raise fault from e
        raise
    return stored

  def _insert_imported(self, kind: str, r: dict) -> int:
    if kind == "feedback":
      cur = self._db.execute("INSERT OR IGNORE INTO feedback VALUES (?,?,?,?,?,?,?,?,?)",
                             (r["id"], r["tenant"], r["session"], r["call_id"], r["created"],
                              r["grade"], None if r["rubric"] is None else json.dumps(r["rubric"]),
                              r["text"], r["source"]))
      return cur.rowcount
    cur = self._db.execute(
        "INSERT OR IGNORE INTO calls VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (r["id"], r["tenant"], r["session"], r["created"], r["kind"], json.dumps(r["request"]),
         None if r["messages"] is None else json.dumps(r["messages"]),
         None if r["tools"] is None else json.dumps(r["tools"]), r["prompt_text"],
         _ids_blob(r["prompt_ids"]), r["parent_call"], r["parent_choice"], r["break_reason"]))
    if cur.rowcount and r["finished"] is not None:
      self._db.execute("INSERT INTO results VALUES (?,?,?,?,?,?,?)",
                       (r["id"], r["finished"], r["status"], r["reason"],
                        None if r["response"] is None else json.dumps(r["response"]),
                        json.dumps(r["choices"]), r["latency_s"]))
    return cur.rowcount


def iter_sessions(store: TraceStore, tenant: str) -> Iterator[tuple[str, list[CallRecord]]]:
  """(session, its calls oldest first) for every session of `tenant`."""
  for s in store.sessions(tenant):
    yield s["id"], store.calls(tenant, s["id"])
