"""Table 1 from fixture run manifests: one column per platform measured, the paper's beside."""

import copy

import pytest

from paper_figs import table1

MACHINE = {
    "machine_id": "abc",
    "os": "Linux",
    "cpu": {"model": "EPYC", "usable_cores": 2, "simd": ["avx2"]},
    "memory": {"total_gib": 23.5},
    "storage": {"device": "/dev/vda", "fstype": "ext4", "rotational": False, "odirect_read": {"gb_per_s_median": 1.5}},
    "gpus": {"note": "none"},
    "versions": {"torch": "2.13.0", "llama_cpp": "0.3.36"},
}


def _manifest(platform, engine, expert_type=None, read_bw=None, bw=1.5):
    m = copy.deepcopy(MACHINE)
    m["storage"]["odirect_read"]["gb_per_s_median"] = bw
    args = {"expert_type": expert_type} if expert_type else {}
    if read_bw:
        args["read_bw"] = read_bw
    return {"config": {"platform": platform, "engine": engine, "method": "ar", "method_args": args}, "machine": m}


def test_columns_group_runs_by_platform_and_keep_caps_and_bandwidth_ranges():
    ms = [
        _manifest("mn", "torch", "q4_0"),
        _manifest("mn", "torch", "q4_0", 16 * 10**6, bw=0.8),
        _manifest("cg", "torch"),
        _manifest("resident", "torch"),
    ]
    cols = table1.columns(ms)
    assert list(cols) == ["cg · torch · checkpoint", "mn · torch · q4_0"]
    mn = cols["mn · torch · q4_0"]
    assert mn["read cap"].startswith("uncapped; 16 MB/s")
    assert "0.80–1.50 GB/s O_DIRECT over 2 runs" in mn["storage / link"]
    t = table1.table(cols)
    assert "| CG (paper) | MN (paper) |" in t.splitlines()[0] and "RTX 4090" in t and "Hexagon" in t


def test_a_machine_record_without_storage_is_named():
    m = _manifest("mn", "torch", "q4_0")
    del m["machine"]["storage"]
    with pytest.raises(ValueError, match="lacks storage"):
        table1.columns([m])
