"""The results store survives SIGKILL mid-write and resumes without redoing finished cells."""

import signal
import subprocess
import sys
import time

import pytest

from bench.runs.results import RecordWriter, cell_key, load_results, read_records

WRITER = r"""
import sys
from bench.runs.results import RecordWriter
run_dir, start = sys.argv[1], int(sys.argv[2])
with RecordWriter(run_dir, fsync=False) as w:
    for i in range(start, 10**9):
        key = f"cfg/p{i}"
        if key in w.done:
            continue
        w.write({"key": key, "i": i, "tokens": list(range(i % 5000)), "pad": "x" * 200000})
"""


def test_sigkill_mid_write_leaves_no_torn_record_and_resumes(tmp_path):
    run = tmp_path / "run"
    torn = False
    for attempt in range(12):  # kill at different moments until one kill tears a line
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(run), "0"])
        path = run / "records.jsonl"
        size0 = path.stat().st_size if path.exists() else 0
        deadline = time.time() + 60
        while time.time() < deadline and (not path.exists() or path.stat().st_size <= size0):
            time.sleep(0.005)
        time.sleep(0.013 * attempt)  # a different moment inside the write loop each time
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        raw = (run / "records.jsonl").read_bytes()
        torn = torn or not raw.endswith(b"\n")
        recs = read_records(run / "records.jsonl")  # never raises on a torn tail
        assert all(r["pad"] == "x" * 200000 for r in recs)
        # the next writer repairs the tail and skips finished keys
        w = RecordWriter(run)
        assert (run / "records.jsonl").read_bytes().endswith(b"\n") or (run / "records.jsonl").stat().st_size == 0
        done_before = set(w.done)
        w.close()
        keys = [r["key"] for r in read_records(run / "records.jsonl")]
        assert len(keys) == len(set(keys)) == len(done_before)
        if torn and attempt >= 3:
            break
    df = load_results(run)
    assert df["key"].is_unique


def test_torn_tail_is_repaired_and_redone(tmp_path):
    run = tmp_path / "run"
    with RecordWriter(run) as w:
        w.write({"key": "a", "v": 1})
        w.write({"key": "b", "v": 2})
    with open(run / "records.jsonl", "ab") as f:
        f.write(b'{"key": "c", "v": 3, "tok')  # what a kill inside write() could leave
    assert [r["key"] for r in read_records(run / "records.jsonl")] == ["a", "b"]
    with RecordWriter(run) as w:
        assert w.repaired_bytes > 0 and w.done == {"a", "b"}
        w.write({"key": "c", "v": 3})
    assert [r["key"] for r in read_records(run / "records.jsonl")] == ["a", "b", "c"]


def test_record_needs_key(tmp_path):
    with RecordWriter(tmp_path) as w, pytest.raises(ValueError):
        w.write({"v": 1})


def test_cell_key_depends_on_config_and_prompt():
    a = cell_key({"method": "ar", "k": 4}, "p1")
    assert a == cell_key({"k": 4, "method": "ar"}, "p1")
    assert a != cell_key({"method": "ar", "k": 5}, "p1") and a != cell_key({"method": "ar", "k": 4}, "p2")


def test_load_results_reads_nested_run_folders(tmp_path):
    for name in ("r1", "sweep/r2"):
        with RecordWriter(tmp_path / name) as w:
            w.write({"key": f"{name}/x", "decode_tps": 1.5})
    df = load_results(tmp_path)
    assert len(df) == 2 and set(df["run_dir"]) == {str(tmp_path / "r1"), str(tmp_path / "sweep" / "r2")}
