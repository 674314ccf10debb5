"""The streaming expert writer: llama.cpp's layout, tensor by tensor, checksummed, all or nothing."""

import json
import os

import gguf
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from bench.cli import app
from draftexpert.runtime.gguf_checksums import checksum_path, verify_checksums
from draftexpert.runtime.gguf_experts import ExpertFile
from draftexpert.runtime.gguf_layout import ExpertFileError
from draftexpert.runtime.gguf_write import write_expert_gguf

META = {"n_layer": 3, "first_dense": 1, "n_expert": 4, "n_embd": 64, "n_ff_exp": 32}


def _layers(order=(1, 2)):
    for layer in order:
        g = torch.Generator().manual_seed(layer)
        yield layer, torch.randn(4, 64, 64, generator=g), torch.randn(4, 64, 32, generator=g)


@pytest.mark.parametrize("qtype", ["f32", "f16", "bf16", "q4_0"])
def test_streamed_file_holds_every_expert_and_its_checksums(tmp_path, qtype):
    path = write_expert_gguf(tmp_path / "e.gguf", _layers(), META, qtype)
    assert verify_checksums(path, full=True) is None and not list(tmp_path.glob("*.part"))
    f = ExpertFile(path, staging_buffers=1)
    try:
        assert f.layers == [1, 2]
        tol = {"f32": 0, "f16": 1e-3, "bf16": 1e-2, "q4_0": 0.3}[qtype]
        for layer, gate_up, down in _layers():
            for e in (0, 3):
                gu, d = f.dequantize(f.read_expert(layer, e), "cpu", torch.float32)
                assert torch.allclose(gu, gate_up[e], atol=tol * 4, rtol=tol)
                assert torch.allclose(d, down[e], atol=tol * 4, rtol=tol)
    finally:
        f.close()


def test_a_checkpoint_that_yields_the_wrong_layers_leaves_nothing(tmp_path):
    for order in ((2, 1), (1,)):
        with pytest.raises(ValueError):
            write_expert_gguf(tmp_path / "e.gguf", _layers(order), META, "f32")
        assert list(tmp_path.iterdir()) == []
    assert not checksum_path(tmp_path / "e.gguf").exists()


def test_the_store_refuses_a_damaged_file_it_wrote(tmp_path):
    path = write_expert_gguf(tmp_path / "e.gguf", _layers(), META, "f32")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        f.write(b"\xff" * 8)
    with pytest.raises(ExpertFileError, match="damaged.*bench convert"):
        ExpertFile(path, staging_buffers=1)


def test_one_expert_is_two_contiguous_reads_and_separate_gate_up_is_refused(tmp_path):
    f = ExpertFile(write_expert_gguf(tmp_path / "e.gguf", _layers(), META, "f32"), staging_buffers=0)
    (gu_off, gu_n), (dn_off, dn_n) = f.ranges(1, 2)
    assert (gu_n, dn_n) == (2 * 32 * 64 * 4, 64 * 32 * 4)  # gate and up of expert 2 in one range
    assert gu_off == f.ranges(1, 0)[0][0] + 2 * gu_n
    f.close()
    w = gguf.GGUFWriter(str(tmp_path / "old.gguf"), "deepseek2")  # llama.cpp's unfused names
    for part, shape in (("gate", (4, 32, 64)), ("up", (4, 32, 64)), ("down", (4, 64, 32))):
        w.add_tensor(f"blk.1.ffn_{part}_exps.weight", np.zeros(shape, np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ExpertFileError, match="lacks ffn_gate_up_exps.*separate gate and up.*bench convert"):
        ExpertFile(tmp_path / "old.gguf", staging_buffers=0)


def test_bench_speed_convert_writes_and_removes_its_file(tmp_path):
    r = CliRunner().invoke(
        app,
        ["speed", "convert", "--model", "ds-tiny", "--layers", "2", "--type", "q4_0", "--dir", str(tmp_path), "--json"],
    )
    out = json.loads(r.output[r.output.index("{") :])
    assert r.exit_code == 0 and out["layers"] == 2 and out["file_bytes"] > 0 and out["peak_rss_bytes"] > 0
    assert list(tmp_path.iterdir()) == []
