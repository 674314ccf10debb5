"""Table 1: the evaluation platforms — ours from the machine records of the runs, the paper's two
beside them. Pure: reads run manifests (`manifest.json`: the cell configuration and the `machine`
block of `bench.runs.telemetry.collect`), formats one column per platform measured: (platform, engine,
expert type, storage read cap), each with the machine it ran on.
"""

from __future__ import annotations

# The paper's Table 1 (configuration rows), quoted.
PAPER = {
    "CG (paper)": {
        "accelerator": "NVIDIA GeForce RTX 4090, 24 GB",
        "host": "host CPU DRAM (64 GB)",
        "experts from": "CPU-resident routed experts, loaded on demand to the GPU",
        "storage / link": "PCIe",
        "runtime": "BF16 PyTorch 2.11.0+cu128",
        "read cap": "—",
    },
    "MN (paper)": {
        "accelerator": "Hexagon HTP v81 NPU (Snapdragon 8 Elite, SM8850)",
        "host": "shared DRAM (phone)",
        "experts from": "Flash, staged into shared memory on demand",
        "storage / link": "UFS Flash",
        "runtime": "llama.cpp, Q4_0 weights",
        "read cap": "—",
    },
}
ROWS = ("machine", "accelerator", "host", "experts from", "storage / link", "runtime", "read cap")


def _gpu(machine: dict) -> str | None:
    gpus = machine.get("gpus")
    if not isinstance(gpus, list) or not gpus:
        return None
    g = gpus[0]
    return f"{g['name']}, {g['memory_gib']:.0f} GB"


def column(config: dict, machines: list[dict], caps: list[int]) -> dict:
    """One platform column from a configuration and the machine records of its runs (the measured
    O_DIRECT bandwidth as its range over them; the read caps the runs were made under)."""
    args = config.get("method_args") or {}
    machine = machines[0]
    cpu, mem, st = machine["cpu"], machine["memory"], machine["storage"]
    bws = sorted(
        m["storage"]["odirect_read"]["gb_per_s_median"]
        for m in machines
        if "gb_per_s_median" in (m["storage"].get("odirect_read") or {})
    )
    bw = (
        f"{bws[0]:.2f}–{bws[-1]:.2f} GB/s O_DIRECT over {len(bws)} runs"
        if len(bws) > 1 and bws[0] != bws[-1]
        else f"{bws[0]:.2f} GB/s O_DIRECT"
        if bws
        else "not measured"
    )
    gpu = _gpu(machine)
    cuda = args.get("device") == "cuda"
    engine, platform = config.get("engine", "torch"), config["platform"]
    vers = machine.get("versions", {})
    runtime = (
        f"llama.cpp {vers.get('llama_cpp')}" if engine == "llama.cpp" else f"PyTorch {vers.get('torch')}"
    ) + f", {args.get('expert_type', 'checkpoint')} experts, fp32 compute"
    gpus = machine.get("gpus")
    link = ""
    if isinstance(gpus, list) and gpus and gpus[0].get("pcie_gen_current"):
        link = f"; PCIe gen{gpus[0]['pcie_gen_current']} x{gpus[0]['pcie_width_current']}"
    capped = sorted({c for c in caps if c})
    return {
        "machine": ", ".join(sorted({f"{m.get('machine_id')} ({m.get('os')})" for m in machines})),
        "accelerator": gpu
        if cuda and gpu
        else f"the CPU: {cpu['model']}, {cpu['usable_cores']} cores ({', '.join(cpu.get('simd', []))})",
        "host": f"{mem['total_gib']:.1f} GiB RAM",
        "experts from": {
            "mn": "a GGUF file on storage, staged on demand",
            "cg": "host memory, copied on demand",
            "resident": "resident (no movement)",
        }[platform],
        "storage / link": f"{st.get('device')} ({st.get('fstype')}, "
        f"{'reported rotational' if st.get('rotational') else 'non-rotational'}), {bw}{link}",
        "runtime": runtime,
        "read cap": "; ".join(
            (["uncapped"] if any(not c for c in caps) else [])
            + ([" / ".join(f"{c // 10**6}" for c in capped) + " MB/s (kernel block-I/O throttle)"] if capped else [])
        ),
    }


def columns(manifests: list[dict]) -> dict[str, dict]:
    """{label: column}, one per (platform, engine, expert type) measured; the resident bound and
    the reference are references, not platforms."""
    for m in manifests:
        absent = [k for k in ("cpu", "memory", "storage") if m.get("machine") and k not in m["machine"]]
        if absent:
            raise ValueError(f"Table 1: a machine record lacks {', '.join(absent)}")
    groups: dict[str, tuple[dict, list, list]] = {}
    for m in manifests:
        c, args = m["config"], m["config"].get("method_args") or {}
        if not m.get("machine") or c["platform"] == "resident" or c["method"] == "reference":
            continue
        label = f"{c['platform']} · {c.get('engine', 'torch')} · {args.get('expert_type', 'checkpoint')}"
        g = groups.setdefault(label, (c, [], []))
        g[1].append(m["machine"])
        g[2].append(args.get("read_bw"))
    return {label: column(c, ms, caps) for label, (c, ms, caps) in sorted(groups.items())}


def table(cols: dict[str, dict]) -> str:
    allc = {**cols, **PAPER}
    lines = ["| item | " + " | ".join(allc) + " |", "|---" * (len(allc) + 1) + "|"]
    for row in ROWS:
        lines.append(f"| {row} | " + " | ".join(c.get(row, "—") for c in allc.values()) + " |")
    return "\n".join(lines) + "\n"
