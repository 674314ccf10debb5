"""Results store: one JSONL record per (run, prompt) and one manifest per run.

Layout of a run folder (`results/<run>/` or any `--out`):
  records.jsonl   one JSON object a line, appended as each cell finishes
  manifest.json   run config, git commit, machine telemetry, and one {start, end, status}
                  entry per session that wrote to the folder (rewritten atomically)

Crash safety. A record is encoded in full, then written with a single `write(2)` on an
`O_APPEND` descriptor and fsync'd, so a killed writer leaves at most one torn last line. On
open, `RecordWriter` truncates a torn tail (a last line without its newline) — the record it
held is not "done" and is redone — and the loader ignores such a tail, so no reader ever sees
a truncated record. A sweep resumes by skipping cells whose key is already in the file. A damaged line elsewhere
(not JSON, or not a record) is reported as `FILE:LINE` on stderr and skipped by every reader, so
its cell is redone; the line itself stays in the file for inspection, never read as a record.
One writer at a time: `RecordWriter` holds an exclusive `flock` on records.jsonl while open (a
second writer waits), so a Ray task retried while its first attempt still runs writes no cell twice.

Folder faults (`RunFolderError`, one line naming the folder): `--out` naming a file, a read-only
or full file system. A session whose writes fail is marked `failed` in the manifest when the
manifest can still be written; no temporary file is left behind.

Record schema (fields every method fills):
  key                 cell identity: "<config hash>/<prompt id>"; resume skips existing keys
  run, config_hash    run name and a hash of the cell's configuration (below)
  model, platform, engine, method, r, k_max, tau, budget, truncate, prefetch, temperature, seed,
  max_new_tokens      the cell's configuration
  prompt_id, category the prompt
  prompt_tokens       tokens in the rendered prompt
  tokens              emitted token ids (exactness is checked by comparing these across runs)
  new_tokens          len(tokens)
  prefill_s           wall seconds of the prefill forward
  decode_s            wall seconds from the end of prefill to the last token
  ledger              the engine's counters for the prompt (requests, loads, bytes, stall per phase)
  counters            rounds, drafted, accepted, … and the ledger's decode-phase movement
                      (`draftexpert.metrics`: the names and their meaning)
  derived figures     decode_tps, acceptance, mean_accepted_length, loading_share, …, each
                      computed by `draftexpert.metrics.derive` from this record's counters
Methods may add fields; the loader keeps every field.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

REPO_ROOT = Path(__file__).resolve().parents[2]


def config_hash(config: dict) -> str:
    """12 hex digits of sha256 over the canonical JSON of a cell's configuration."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cell_key(config: dict, prompt_id: str) -> str:
    return f"{config_hash(config)}/{prompt_id}"


def git_commit(repo: Path = REPO_ROOT) -> dict:
    def git(*args):
        p = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(dirty) if dirty is not None else None}


def _repair_tail(path: Path) -> int:
    """Truncate a torn last line (no trailing newline); return the bytes removed."""
    if not path.exists() or path.stat().st_size == 0:
        return 0
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        # scan back for the previous newline
        pos, chunk = size, 1 << 16
        while pos > 0:
            start = max(0, pos - chunk)
            f.seek(start)
            data = f.read(pos - start)
            nl = data.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        else:
            keep = 0
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
        return size - keep


class RunFolderError(OSError):
    """A run folder that cannot hold results: not a folder, not writable, or its disk is full."""


def check_run_dir(run_dir: Path) -> Path:
    """Create `run_dir` if needed and make sure records can be written there; else RunFolderError."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderError(f"--out {run_dir} is a file, not a folder: pass a folder for the run's records")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunFolderError(f"--out {run_dir} cannot be created ({e.strerror})") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise RunFolderError(f"--out {run_dir} is not writable (read-only file system or permissions): "
                             "pass a folder you can write to")
    return run_dir


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def read_records(path: Path, warn=_warn) -> list[dict]:
    """Every complete record in a records.jsonl. A torn last line is ignored (the writer repairs
    it); a damaged line elsewhere is reported as FILE:LINE through `warn` and skipped."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    out = []
    for n, line in enumerate(lines[:-1], 1):  # the part after the last newline is empty or torn
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            warn(f"{path}:{n}: damaged record skipped ({getattr(e, 'msg', e)}); its cell will be redone")
            continue
        if not isinstance(rec, dict) or "key" not in rec:
            warn(f"{path}:{n}: not a record (no cell key), skipped")
            continue
        out.append(rec)
    return out


class RecordWriter:
    """Append-only, crash-safe writer of one run folder's records.jsonl. It holds an exclusive lock
    on the file while open, so two writers of one folder (a retried Ray task whose first attempt
    still runs, two shells) never interleave: the second waits, then sees the first one's records."""

    def __init__(self, run_dir: Path, fsync: bool = True, warn=_warn):
        self.run_dir = check_run_dir(run_dir)
        self.path = self.run_dir / "records.jsonl"
        self._fd = -1
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                warn(f"{self.path} is being written by another process; waiting for it to finish")
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            self.repaired_bytes = _repair_tail(self.path)
            self.done: set[str] = {r["key"] for r in read_records(self.path)}
            self.fsync = fsync
        except OSError as e:
            self.close()
            raise RunFolderError(f"{self.path}: {e.strerror or e}") from None

    def write(self, record: dict) -> None:
        if "key" not in record:
            raise ValueError("a record needs its cell `key` (see cell_key)")
        line = (json.dumps(record, sort_keys=True, default=_jsonable) + "\n").encode()
        view, written = memoryview(line), 0
        start = os.fstat(self._fd).st_size
        try:
            while written < len(line):  # a regular-file write is whole in practice; loop for correctness
                written += os.write(self._fd, view[written:])
            if self.fsync:
                os.fsync(self._fd)
        except OSError as e:
            try:  # take back any part of the line, so the file ends on a whole record
                os.ftruncate(self._fd, start)
            except OSError:
                pass  # the next writer repairs the torn tail
            raise RunFolderError(f"writing {self.path} failed: {e.strerror or e}; the records before this one "
                                 "are kept — free space (or fix the folder) and rerun the same command to "
                                 "resume") from None
        self.done.add(record["key"])

    def close(self):
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _jsonable(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def write_json_atomic(path: Path, obj) -> None:
    """Write whole or not at all: a temporary file beside `path`, renamed over it; removed on failure."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True, default=_jsonable)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise RunFolderError(f"writing {path} failed: {e.strerror or e}") from None


class RunManifest:
    """manifest.json of a run folder; each session appends {start, end, status, argv}."""

    def __init__(self, run_dir: Path, config: dict, machine: dict | None = None):
        self.path = check_run_dir(run_dir) / "manifest.json"
        try:
            old = json.loads(self.path.read_text()) if self.path.exists() else {}
        except ValueError:
            _warn(f"{self.path} is damaged (not JSON); a new manifest replaces it (the records are untouched)")
            old = {}
        self.data = {
            "config": config,
            "git": git_commit(),
            "machine": machine if machine is not None else old.get("machine"),
            "sessions": old.get("sessions", []),
            "created": old.get("created", _now()),
        }
        self.session = {"start": _now(), "end": None, "status": "running", "argv": sys.argv,
                         "host": socket.gethostname(), "pid": os.getpid()}  # who wrote (a sweep's worker)
        self.data["sessions"].append(self.session)
        write_json_atomic(self.path, self.data)

    def finish(self, status: str = "complete", **extra) -> None:
        self.session.update(end=_now(), status=status, **extra)
        write_json_atomic(self.path, self.data)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def load_results(*paths: Path | str) -> "pandas.DataFrame":  # noqa: F821
    """All records under the given run folders or records.jsonl files (recursively), one row
    per record, with the run's folder in `run_dir`. The single loader `paper_figs` uses."""
    rows = []
    for p in map(Path, paths):
        files = [p] if p.is_file() else sorted(p.rglob("records.jsonl"))
        for f in files:
            for r in read_records(f):
                r.setdefault("run_dir", str(f.parent))
                rows.append(r)
    return pd.DataFrame(rows)
