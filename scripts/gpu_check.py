"""The prepared GPU check: cg's path on a bare CUDA machine, in a few minutes.

    PYTHONPATH=. python3 scripts/gpu_check.py [--device cuda] [--out gpu_check.json]

Needs only the machine's own torch and transformers (DeepseekV2/V3) and safetensors — no install
step, no network, no `bench` (its CLI dependencies), no committed weights: random-weight models
are built on the spot, so a code-only copy of `draftexpert/`, `baselines/` and `scripts/` (about
1 MB: `git archive HEAD draftexpert baselines scripts`) is enough.

Checks (exit 1 if any fails):
  exactness   on the device, for a V2 and a V3 model: AR on the host store (pinned pool, copy
              streams, events) = AR resident; top-r (fixed K) and DraftExpert (random draft expert,
              truncation + prefetch, a bounded working set) = AR, token for token, in fp32; the
              compiled one-token step = eager; T > 0 reproducible per seed (CPU generators);
              bf16: host = resident (the same model), speculation's agreement with AR reported
              (bf16 rounds a verify block and a one-token step differently). Notes: how far a
              verify pass's rows are from the one-token steps (fp32, bf16), host syncs per AR token.
  transfer    a DS-V2-Lite layer's 6 experts (17.3 MB each, bf16) through the host store against
              one copy of the same bytes from pinned memory; pinned bytes vs data bytes.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import transformers
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baselines.ar import AROffloadDecoder  # noqa: E402
from draftexpert.engines.torch_engine import TorchEngine  # noqa: E402
from draftexpert.runtime.experts import HostPool, HostStore  # noqa: E402
from draftexpert.runtime.loader import build_model  # noqa: E402
from draftexpert.runtime.model import KVCache  # noqa: E402
from draftexpert.speculation.drafters import DraftExperts, make_draft_path  # noqa: E402
from draftexpert.speculation.round import SpecConfig, SpeculativeDecoder  # noqa: E402

DIMS = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=32,
    n_shared_experts=2,
    num_experts_per_tok=6,
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_group=1,
    topk_group=1,
)
PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((5, 9, 14, 3))]
NEW = 32
DS_LAYER = dict(experts=6, hidden=2048, inter=1408)  # DS-V2-Lite: hidden 2048, moe_intermediate 1408, top-6


def random_checkpoint(folder: Path, version: str) -> Path:
    torch.manual_seed(0)
    if version == "v2":
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**DIMS, topk_method="greedy"))
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**DIMS, norm_topk_prob=True, routed_scaling_factor=2.5))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    out = folder / version
    model.save_pretrained(out)
    return out


def decode(decoder, prompts=PROMPTS, new=NEW) -> list[list[int]]:
    out = [decoder.generate(list(p), new).tokens for p in prompts]
    decoder.close()
    return out


def speculative(model, method: str, conf: SpecConfig):
    cfg = model.cfg
    experts = None
    if method == "draftexpert":
        experts = DraftExperts.random(
            list(range(cfg.first_dense, cfg.layers)), cfg.hidden, cfg.moe_inter, dtype=model.embed.dtype
        )
    return SpeculativeDecoder(TorchEngine(model, make_draft_path(model, method, r=1, experts=experts)), conf)


def exactness(folder: Path, device: str) -> dict:
    """Each check in its own guard: one that raises is reported (as its error) and the rest still run,
    so a single pass on a GPU says everything it can."""
    checks, notes, errors = {}, {}, {}
    f32 = torch.float32
    host = lambda **kw: build_model(folder, "host", device=device, dtype=kw.pop("dtype", f32), **kw)  # noqa: E731
    de = SpecConfig(k_max=4, truncate=True, prefetch=True)
    one = 3 * DIMS["hidden_size"] * DIMS["moe_intermediate_size"] * 4

    def guarded(name: str, fn, into: dict) -> None:
        t0 = time.perf_counter()
        try:
            into[name] = fn()
        except Exception as e:  # noqa: BLE001 -- reported, and counted as a failed check
            into[name] = False if into is checks else None
            errors[name] = (
                "".join(traceback.format_exception_only(e)).strip()
                + " @ "
                + " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_tb(e.__traceback__)[-4:])
            )
        print(f"  {name}: {into[name]} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)

    def compiled_ar():
        model = host()
        model.compile_decode()
        return decode(AROffloadDecoder(TorchEngine(model)))

    def sampled(seed: int):
        return decode(speculative(host(), "draftexpert", SpecConfig(k_max=4, temperature=0.8, seed=seed)), PROMPTS[:2])

    resident = decode(AROffloadDecoder(TorchEngine(build_model(folder, "resident", device=device, dtype=f32))))
    guarded("ar host = ar resident", lambda: decode(AROffloadDecoder(TorchEngine(host()))) == resident, checks)
    guarded(
        "top-1 fixed K = ar",
        lambda: decode(speculative(host(), "top-r", SpecConfig(k_max=4, truncate=False, prefetch=False))) == resident,
        checks,
    )
    guarded(
        "draftexpert truncate+prefetch = ar", lambda: decode(speculative(host(), "draftexpert", de)) == resident, checks
    )
    guarded(
        "draftexpert, working set 10 experts = ar",
        lambda: decode(speculative(host(working_set_bytes=10 * one), "draftexpert", de)) == resident,
        checks,
    )
    guarded("compiled ar = eager ar", lambda: compiled_ar() == resident, checks)
    runs = {}
    guarded("T > 0 reproducible per seed", lambda: runs.setdefault("a", sampled(1)) == sampled(1), checks)
    guarded("T > 0: another seed, other tokens", lambda: runs["a"] != sampled(2), notes)
    for name, dt in (("fp32", f32), ("bf16", torch.bfloat16)):
        guarded(
            f"{name}: verify rows vs one-token steps, max |logit difference|",
            lambda dt=dt: verify_gap(host(dtype=dt)),
            notes,
        )
    if device == "cuda":
        guarded("host syncs per token (AR, host store)", lambda: host_syncs(host()), notes)
    bf16_res = []
    guarded(
        "bf16: ar host = ar resident",
        lambda: (
            bf16_res.extend(
                decode(
                    AROffloadDecoder(TorchEngine(build_model(folder, "resident", device=device, dtype=torch.bfloat16)))
                )
            )
            or decode(AROffloadDecoder(TorchEngine(host(dtype=torch.bfloat16)))) == bf16_res
        ),
        checks,
    )
    guarded(
        "bf16: draftexpert prompts equal to ar",
        lambda: "{}/{}".format(
            sum(a == b for a, b in zip(decode(speculative(host(dtype=torch.bfloat16), "draftexpert", de)), bf16_res)),
            len(PROMPTS),
        ),
        notes,
    )
    return {"checks": checks, "notes": notes, "errors": errors}


def verify_gap(model, prompt=PROMPTS[2], block: int = 5) -> float:
    """How far a verify pass's rows are from the one-token steps that AR takes over the same tokens
    (max |Δ logit|): what exactness rests on. Not bitwise — the block's GEMMs and its per-expert
    sums round otherwise — so a greedy token can differ only where the top two logits are closer."""
    ids = torch.tensor(prompt)  # [S]: the last `block` tokens verified at once, or stepped one by one
    dt, dev = model.embed.dtype, model.embed.device

    def prefilled():
        cache = KVCache(model.cfg, 64, device=dev, dtype=dt)
        model.forward(ids[:-block], cache, "prefill")
        return cache

    steps_cache, block_cache = prefilled(), prefilled()
    steps = torch.cat([model.forward(ids[j : j + 1], steps_cache, "ar") for j in range(len(ids) - block, len(ids))])
    rows = model.forward(ids[-block:], block_cache, "verify")
    model.experts.close()
    return float((rows.float() - steps.float()).abs().max())


def host_syncs(model, new: int = 16) -> dict:
    """What makes the host wait on the GPU during AR decoding (torch's sync debug mode): per token,
    and the three lines that do it most (by design one routing read-back per MoE layer)."""
    decoder = AROffloadDecoder(TorchEngine(model))
    decoder.generate(list(PROMPTS[0]), 4)  # warm-up
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            decoder.generate(list(PROMPTS[1]), new)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    decoder.close()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    sites = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return {
        "per_token": len(syncs) / new,
        "moe_layers": DIMS["num_hidden_layers"] - DIMS["first_k_dense_replace"],
        "top_sites": dict(sites.most_common(3)),
    }


def _median_s(fn, repeats: int, sync) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def transfer(device: str, repeats: int = 20) -> dict:
    """A DS-V2-Lite layer's 6 experts through the host store vs one copy of as many bytes."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    pool = HostPool([1], DS_LAYER["experts"], DS_LAYER["hidden"], DS_LAYER["inter"], torch.bfloat16)
    pool.flat.normal_()
    store = HostStore(pool.gate_up, pool.down, pool=pool, device=device, dtype=torch.bfloat16)
    experts = list(range(DS_LAYER["experts"]))
    store.fetch(1, experts)  # warm-up: streams, allocator
    with store.ledger.forward("ar", 1):
        store_s = _median_s(lambda: store.fetch(1, experts), repeats, sync)
    src = torch.empty(pool.nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(pool.nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    copy_s = _median_s(lambda: dst.copy_(src, non_blocking=True), repeats, sync)
    pinned = pool.flat.is_pinned() if cuda else False
    store.close()
    data = DS_LAYER["experts"] * 3 * DS_LAYER["hidden"] * DS_LAYER["inter"] * 2
    return {
        "bytes": data,
        "pool_bytes": pool.nbytes,
        "pool_pinned": pinned,
        "torch_pinned_allocator_would_take": 1 << (data - 1).bit_length(),
        "host_store_s": store_s,
        "one_copy_s": copy_s,
        "host_store_gb_s": data / store_s / 1e9,
        "one_copy_gb_s": data / copy_s / 1e9,
        "efficiency": copy_s / store_s,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: torch sees no CUDA device (use --device cpu to run the same checks on the CPU)", file=sys.stderr
        )
        return 2
    t0 = time.perf_counter()
    report = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "models": {},
    }

    def save() -> None:  # after every stage: a run cut short still leaves what it measured
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        for version in ("v2", "v3"):
            try:
                report["models"][version] = exactness(random_checkpoint(Path(tmp), version), args.device)
            except Exception:  # noqa: BLE001 -- the model or its resident reference did not run
                report["models"][version] = {"checks": {"runs": False}, "errors": {"runs": traceback.format_exc()}}
            print(f"{version}: {json.dumps(report['models'][version])}", file=sys.stderr, flush=True)
            save()
    try:
        report["transfer"] = transfer(args.device)
    except Exception:  # noqa: BLE001
        report["transfer"] = {"error": traceback.format_exc()}
    report["seconds"] = time.perf_counter() - t0
    failed = [f"{v}: {name}" for v, r in report["models"].items() for name, ok in r["checks"].items() if not ok]
    failed += ["transfer"] if "error" in report["transfer"] else []
    report["failed"] = failed
    print(json.dumps(report, indent=2))
    save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
