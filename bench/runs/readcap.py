"""A real storage read-bandwidth cap: the kernel's block-I/O throttle on the device that holds the
expert file, for this process and all its threads (`--read-bw 64MB/s`).

The paper's regime (moving experts dominates the step) does not appear on a machine whose disk
reads a tiny model's experts about as fast as it computes them. Instead of modelling the disk or
sleeping, the suite asks the kernel to rate-limit the real reads from the real disk:

  cgroup v1  a child of the blkio hierarchy, `blkio.throttle.read_bps_device = "MAJ:MIN BYTES"`
  cgroup v2  a child of the unified hierarchy with the io controller, `io.max = "MAJ:MIN rbps=BYTES"`

and moves this process into it (`cgroup.procs` moves every thread: the flash store's O_DIRECT
readers and llama.cpp's page-fault and readahead reads alike). Page-cache hits are not reads and
are not throttled — which is why both engines evict or bypass the page cache for experts. The
kernel lets a group run ahead by one throttle slice (≤ 100 ms of the rate) before it holds it.
Needs root (or a delegated cgroup); refuses with the reason otherwise. The cap is recorded in
every capped cell's `method_args` and in the run's manifest.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class ReadCapError(RuntimeError):
    """The cap cannot be applied here (no block-I/O controller, no permission, no block device)."""


def parse_rate(text: str) -> int:
    """'64MB/s', '64MiB/s', '512KB/s', '1e6' → bytes per second (MB = 10^6, MiB = 2^20)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmg]i?b|b)?\s*(?:/s)?\s*", text.lower())
    if not m:
        raise ValueError(f"--read-bw: {text!r} is not a rate (e.g. 64MB/s, 16MiB/s)")
    rate = int(float(m.group(1)) * UNITS[m.group(2) or ""])
    if rate < 4096:
        raise ValueError(f"--read-bw: {text!r} is below one page per second")
    return rate


def block_device(path: Path) -> str:
    """'MAJ:MIN' of the whole disk that holds `path` (the throttle works on disks, not partitions)."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sysdev = Path("/sys/dev/block") / dev
    if not sysdev.exists():
        raise ReadCapError(f"{path} is not on a block device (its file system is {dev}: tmpfs, overlay or a network "
                           "file system?); put the expert files on a disk to cap their reads")
    if (sysdev / "partition").exists():  # a partition: throttle its disk
        dev = (sysdev.resolve().parent / "dev").read_text().strip()
    return dev


def _remove_stale_groups(root: Path) -> None:
    """Groups left by a killed run (its process gone, the group empty) are removed."""
    for group in root.glob("draftexpert-readcap-*"):
        pid = group.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            try:
                group.rmdir()
            except OSError:
                pass


class ReadCap:
    """The cap as a context: `with ReadCap(rate, path): ...` runs the block with this process's
    reads from `path`'s disk throttled to `rate` bytes/s; `set(rate)` changes it in place."""

    def __init__(self, rate: int, path: Path):
        self.rate, self.device = rate, block_device(path)
        self.group: Path | None = None
        self.v2 = not (CGROUP / "blkio").is_dir() and (CGROUP / "cgroup.controllers").exists()

    def _root(self) -> Path:
        if self.v2:
            if "io" not in (CGROUP / "cgroup.controllers").read_text().split():
                raise ReadCapError("cgroup v2 without the io controller: the kernel cannot throttle reads here")
            return CGROUP
        root = CGROUP / "blkio"
        if not (root / "blkio.throttle.read_bps_device").exists():
            raise ReadCapError(f"no blkio throttle at {root} (cgroup v1 without blk-throttle, or no cgroups mounted)")
        return root

    def __enter__(self) -> ReadCap:
        root = self._root()
        self.parent = root
        _remove_stale_groups(root)
        self.group = root / f"draftexpert-readcap-{os.getpid()}"
        try:
            self.group.mkdir(exist_ok=True)
            if self.v2:
                (root / "cgroup.subtree_control").write_text("+io")
            self.set(self.rate)
            (self.group / "cgroup.procs").write_text(str(os.getpid()))
        except PermissionError as e:
            self._remove()
            raise ReadCapError(f"--read-bw needs root (or a delegated cgroup) to throttle {self.device}: {e}") from e
        except OSError as e:
            self._remove()
            raise ReadCapError(f"--read-bw: the kernel refused the cap on {self.device} ({e})") from e
        return self

    def set(self, rate: int) -> None:
        self.rate = rate
        if self.v2:
            (self.group / "io.max").write_text(f"{self.device} rbps={rate}")
        else:
            (self.group / "blkio.throttle.read_bps_device").write_text(f"{self.device} {rate}")

    def _remove(self) -> None:
        if self.group is not None and self.group.exists():
            try:
                self.group.rmdir()
            except OSError:
                pass

    def __exit__(self, *exc) -> None:
        (self.parent / "cgroup.procs").write_text(str(os.getpid()))  # back out, then the group can go
        self._remove()

    def describe(self) -> dict:
        return {"read_bw_bytes_per_s": self.rate, "device": self.device,
                "mechanism": "cgroup v2 io.max rbps" if self.v2 else "cgroup v1 blkio.throttle.read_bps_device"}
