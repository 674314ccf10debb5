"""Platform telemetry: what machine a run was on (Table 1), written into every run's manifest.

CPU model and cores, RAM, the storage device behind a folder and its O_DIRECT read bandwidth
(measured, the page cache bypassed), library versions, and — through NVML when `nvidia-ml-py`
is installed and a GPU is present — GPU name, memory and PCIe link — and the copy bandwidth into
the accelerator that platform cg's experts cross (pinned host → GPU; on the CPU a memcpy).
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import platform
import time
from pathlib import Path

import torch

from bench.suites.sources import cache_dir
from draftexpert.engines.llamacpp import build_info


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def cpu() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                  if line.startswith("model name")), platform.processor() or platform.machine())
    flags = next((line.split(":", 1)[1].split() for line in _read("/proc/cpuinfo").splitlines()
                  if line.startswith("flags")), [])
    return {"model": model, "logical_cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "arch": platform.machine(),
            "simd": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]}


def memory() -> dict:
    info = {}
    for line in _read("/proc/meminfo").splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            info[key] = int(rest.split()[0]) * 1024
    return {"total_gib": info.get("MemTotal", 0) / 2**30, "available_gib": info.get("MemAvailable", 0) / 2**30}


def storage_device(path: Path) -> dict:
    """The block device holding `path` (from /proc/self/mountinfo and /sys/block)."""
    path = path.resolve()
    best, dev, fstype = "", "", ""
    for line in _read("/proc/self/mountinfo").splitlines():
        parts = line.split()
        if " - " not in line:
            continue
        mnt = parts[4]
        post = line.split(" - ", 1)[1].split()
        if str(path).startswith(mnt) and len(mnt) >= len(best):
            best, fstype, dev = mnt, post[0], post[1]
    name = Path(dev).name
    sysblock = Path("/sys/class/block") / name
    parent = sysblock.resolve().parent.name if (sysblock / "partition").exists() else name
    q = Path("/sys/block") / parent / "queue"
    return {"mount": best, "device": dev, "fstype": fstype,
            "model": _read(f"/sys/block/{parent}/device/model").strip() or None,
            "rotational": _read(str(q / "rotational")).strip() == "1" if (q / "rotational").exists() else None,
            "logical_block_size": int(_read(str(q / "logical_block_size")) or 0) or None}


def odirect_read_bandwidth(folder: Path, block_size: int = 1 << 20, file_size: int = 64 << 20, passes: int = 3,
                           keep: bool = False) -> dict:
    """Read a `file_size` file in `folder` with O_DIRECT, `block_size` bytes a read, one read in
    flight; GB/s = bytes / seconds / 1e9 (best and median of `passes`). The page cache is
    bypassed; a hypervisor below this machine may still cache ("storage as this machine sees it").
    `keep`: the probe file (`.odirect-probe`) is written once and kept for the next measurement
    — what every run does, in the expert files' cache folder, so a run writes nothing to measure;
    else a fresh file is written and removed (`bench env`)."""
    if not hasattr(os, "O_DIRECT"):
        return {"error": "O_DIRECT is not available on this OS"}
    path = folder / (".odirect-probe" if keep else f".odirect-probe-{os.getpid()}")
    block_size = max(4096, block_size // 4096 * 4096)
    file_size = max(block_size, file_size // block_size * block_size)
    try:
        if not (keep and path.is_file() and path.stat().st_size >= file_size):
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".odirect-probe-{os.getpid()}.tmp")
            try:
                with open(tmp, "wb") as f:
                    chunk = os.urandom(1 << 20)
                    for _ in range(file_size // len(chunk) + 1):
                        f.write(chunk)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        buf = mmap.mmap(-1, block_size)  # page-aligned, as O_DIRECT requires
        times = []
        for _ in range(passes):
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                t0 = time.perf_counter()
                off = 0
                while off < file_size:
                    n = os.preadv(fd, [buf], off)
                    if n <= 0:
                        break
                    off += n
                times.append(time.perf_counter() - t0)
            finally:
                os.close(fd)
        times.sort()
        return {"path": str(folder), "block_bytes": block_size, "file_bytes": file_size, "passes": passes,
                "gb_per_s_best": file_size / times[0] / 1e9,
                "gb_per_s_median": file_size / times[len(times) // 2] / 1e9}
    except OSError as e:
        return {"path": str(folder), "block_bytes": block_size, "error": f"{type(e).__name__}: {e}"}
    finally:
        if not keep:
            path.unlink(missing_ok=True)


def gpus() -> list[dict] | dict:
    try:
        import pynvml  # noqa: PLC0415  (from nvidia-ml-py, the optional extra `gpu`)
    except ImportError:
        return {"note": "nvidia-ml-py not installed (pip install -e '.[gpu]')"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return {"note": f"no NVIDIA GPU visible: {e}"}
    out = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            rec = {"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                   "memory_gib": mem.total / 2**30}
            for key, fn in (("pcie_gen_current", "nvmlDeviceGetCurrPcieLinkGeneration"),
                            ("pcie_width_current", "nvmlDeviceGetCurrPcieLinkWidth"),
                            ("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
                            ("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth")):
                try:
                    rec[key] = getattr(pynvml, fn)(h)
                except pynvml.NVMLError:
                    rec[key] = None
            try:
                rec["driver"] = pynvml.nvmlSystemGetDriverVersion()
            except pynvml.NVMLError:
                pass
            out.append(rec)
    finally:
        pynvml.nvmlShutdown()
    return out


def copy_in_bandwidth(nbytes: int = 128 << 20, passes: int = 5) -> dict:
    """Bytes/s of one copy of `nbytes` into the accelerator, as the host store copies an expert (median of
    `passes`): `cpu` a memcpy between host buffers (the CPU as the accelerator), `cuda` from page-locked
    host memory to the GPU when there is one — cg's physical limit is this rate over the bytes a token moves."""
    def median_rate(dst, src, sync) -> float:
        times = []
        for _ in range(passes + 1):  # the first: allocator and page faults
            sync()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync()
            times.append(time.perf_counter() - t0)
        return nbytes / sorted(times[1:])[passes // 2]

    out = {"bytes": nbytes, "cpu_gb_per_s": median_rate(torch.empty(nbytes, dtype=torch.uint8),
                                                       torch.ones(nbytes, dtype=torch.uint8), lambda: None) / 1e9}
    if torch.cuda.is_available():
        out["cuda_pinned_gb_per_s"] = median_rate(torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
                                                  torch.ones(nbytes, dtype=torch.uint8).pin_memory(),
                                                  torch.cuda.synchronize) / 1e9
    return out


def versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "tokenizers", "safetensors", "numpy", "llama_cpp", "gguf"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken optional module
            out[mod] = None
    out["torch_cuda"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    out["torch_threads"] = torch.get_num_threads()
    if out["llama_cpp"]:  # the build flags exactness depends on (docs/LLAMACPP.md)
        out["llama_cpp_build"] = build_info()
    return out


def machine_id(t: dict | None = None) -> str:
    """12 hex digits identifying the machine a measurement was made on (host name, CPU model,
    cores, RAM, GPUs): part of every result cell's key, so results from another machine are
    measured anew rather than skipped as done."""
    t = t or {"hostname": platform.node(), "cpu": cpu(), "memory": memory(), "gpus": gpus()}
    gpu = [g["name"] for g in t["gpus"]] if isinstance(t["gpus"], list) else []
    ident = [t["hostname"], t["cpu"]["model"], t["cpu"]["logical_cores"], round(t["memory"]["total_gib"]), gpu]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:12]


def expert_storage() -> Path:
    """Where the expert files are read from (their cache folder): the storage a run measures."""
    return cache_dir() / "gguf"


def collect(storage_path: Path | None = None, block_size: int = 1 << 20, measure_io: bool = True,
            keep_probe: bool = False) -> dict:
    """Everything above as one dict (the `machine` block of a run manifest). Runs pass
    `expert_storage()` with `keep_probe`: the disk the experts come from, probed without a write."""
    storage_path = storage_path or Path.cwd()
    t = {
        "hostname": platform.node(), "os": f"{platform.system()} {platform.release()}",
        "cpu": cpu(), "memory": memory(),
        "storage": {**storage_device(storage_path),
                    "odirect_read": odirect_read_bandwidth(storage_path, block_size, keep=keep_probe) if measure_io
                    else None},
        "gpus": gpus(), "copy_in": copy_in_bandwidth() if measure_io else None, "versions": versions(),
    }
    t["machine_id"] = machine_id(t)
    return t
