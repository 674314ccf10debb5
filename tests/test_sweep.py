"""`bench sweep GRID.toml`: grid files, shards, and Ray — a killed worker's task is retried and
every cell lands exactly once, with the same records as the in-process sweep."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from bench.steps.grid import GridError, collect, read_grid, run_sweep


def _grid(tmp_path, ckpt, text=None, name="grid.toml"):
    f = tmp_path / name
    f.write_text(
        text
        if text is not None
        else f"""
[prompts]
suite = ["gsm8k"]
limit = 8
shards = 2
[decode]
max_new_tokens = 24
[grid]
model = "ds-tiny"
model_path = "{ckpt}"
platform = ["resident"]
method = ["ar", "top-r"]
[settings]
r = [1]
k_max = [3]
"""
    )
    return f


def test_a_grid_expands_to_cells_times_shards(tmp_path, tiny_checkpoint):
    tasks, _ = read_grid(_grid(tmp_path, tiny_checkpoint))
    assert [(t.method, t.settings, t.shard) for t in tasks] == [
        ("ar", {}, 0),
        ("ar", {}, 1),
        ("top-r", {"k_max": 3, "r": 1}, 0),
        ("top-r", {"k_max": 3, "r": 1}, 1),
    ]
    assert len({t.folder for t in tasks}) == 4


def test_a_grid_carries_the_head_type_to_its_torch_cells(tmp_path):
    text = "[grid]\nengine = ['torch', 'llama.cpp']\nplatform = ['mn']\nhead_type = 'q4_0'\n"
    tasks, _ = read_grid(_grid(tmp_path, None, text))
    assert {(t.engine, t.head_type) for t in tasks} == {("torch", "q4_0"), ("llama.cpp", "checkpoint")}


def test_the_shipped_grids_parse():
    grids = sorted((Path(__file__).parents[1] / "bench" / "data" / "grids").glob("*.toml"))
    assert {g.stem for g in grids} >= {"example", "paper-cg", "paper-mn"}
    for g in grids:
        tasks, _ = read_grid(g)
        assert tasks and all(t.gpus == (1 if t.platform == "cg" else 0) for t in tasks)


@pytest.mark.parametrize(
    "text, words",
    [
        ("[grid]\nmethod = ['ar']\nmodle = ['ds']\n", "[grid] modle: unknown key"),
        ("[grid]\nplatform = ['phone']\n", "[grid] platform: phone not one of"),
        ("[grid]\nengine = ['llama.cpp']\nplatform = ['cg']\n", "engine llama.cpp runs platforms mn and resident"),
        ("[settings]\nk_max = ['four']\n", "[settings] k_max: 'four' is not int"),
        ("[prompts]\nsuite = ['poems']\n", "[prompts] suite: unknown poems"),
        ("[grid\n", "not TOML"),
        ("[output]\n", "unknown section or key 'output'"),
        ("[grid]\nhead_type = 'q8_0'\n", "[grid] head_type: 'q8_0' not one of checkpoint, q4_0"),
    ],
)
def test_a_bad_grid_names_the_key(tmp_path, text, words):
    with pytest.raises(GridError, match=None) as e:
        read_grid(_grid(tmp_path, None, text))
    assert words in str(e.value) and "grid.toml" in str(e.value)


def _kill_first_running_worker(out, killed: list, stop: threading.Event):
    """SIGKILL the worker of the first task seen mid-cell (some records written, session running), once."""
    while not stop.is_set() and not killed:
        for m in out.rglob("manifest.json"):
            recs = m.parent / "records.jsonl"
            try:
                session = json.loads(m.read_text())["sessions"][-1]
                lines = len(recs.read_text().splitlines()) if recs.exists() else 0
            except (ValueError, OSError):
                continue
            if session["status"] == "running" and 1 <= lines < 4 and session["pid"] != os.getpid():
                os.kill(session["pid"], signal.SIGKILL)
                killed.append((m.parent, session["pid"], lines))
                return
        time.sleep(0.01)


def test_ray_retries_a_killed_task_and_every_cell_lands_once(tmp_path, tiny_checkpoint):
    ray = pytest.importorskip("ray")
    tasks, _ = read_grid(_grid(tmp_path, tiny_checkpoint))
    local = run_sweep(tasks, tmp_path / "local", log=lambda m: None)
    assert sum(t["written"] for t in local) == 16

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    killed, stop = [], threading.Event()
    watcher = threading.Thread(target=_kill_first_running_worker, args=(tmp_path / "ray", killed, stop), daemon=True)
    watcher.start()
    try:
        run_sweep(tasks, tmp_path / "ray", use_ray=True, log=lambda m: None)
    finally:
        stop.set()
        watcher.join()
        ray.shutdown()
    assert killed, "no worker was caught mid-cell (the cells finished too fast to kill one)"
    folder, pid, _ = killed[0]
    sessions = json.loads((folder / "manifest.json").read_text())["sessions"]
    assert len(sessions) >= 2 and sessions[0]["pid"] == pid and sessions[-1]["pid"] != pid
    assert sessions[-1]["status"] == "complete"

    recs = collect(tmp_path / "ray")
    keys = [r["key"] for r in recs]
    assert len(keys) == len(set(keys)) == 16  # every cell exactly once, the killed one's too
    tokens = lambda rs: {r["key"]: r["tokens"] for r in rs}  # noqa: E731
    assert tokens(recs) == tokens(collect(tmp_path / "local"))
