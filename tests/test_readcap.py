"""The storage read-bandwidth cap (`--read-bw`) is real: the kernel throttles this process's reads
from the disk, so a capped O_DIRECT read of N bytes takes at least N / cap (less the one throttle
slice of run-ahead the kernel allows); bad rates, a file on no block device and a machine without
the controller or the permission are refused with a clear error."""

import contextlib
import mmap
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.runs.readcap import ReadCap, ReadCapError, block_device, parse_rate

REPO = Path(__file__).resolve().parents[1]
THROTTLE_SLICE_S = 0.1  # blk-throttle lets a group run ahead by at most one slice (100 ms) of its rate


def test_rates_parse_and_bad_ones_are_named():
    assert parse_rate("64MB/s") == 64 * 10**6
    assert parse_rate("16MiB/s") == 16 * 2**20
    assert parse_rate("512KB/s") == 512_000
    assert parse_rate("1e6") == 10**6
    for bad in ("fast", "64 furlongs", "-3MB/s", "10"):
        with pytest.raises(ValueError, match="--read-bw"):
            parse_rate(bad)


def test_a_file_on_no_block_device_is_refused(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm here")
    with pytest.raises(ReadCapError, match="not on a block device"):
        block_device(shm)


def _odirect_read(path: Path) -> tuple[int, float]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf, n = mmap.mmap(-1, 1 << 20), 0
    t0 = time.perf_counter()
    while (got := os.preadv(fd, [buf], n)) > 0:
        n += got
    os.close(fd)
    return n, time.perf_counter() - t0


def test_the_cap_throttles_real_reads(tmp_path):
    folder = REPO / "work" / "pytest-readcap"
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / "probe.bin"
    probe.write_bytes(os.urandom(16 << 20))
    os.sync()
    rate = parse_rate("32MiB/s")
    if not Path("/proc/999999").exists():  # a group as a killed run leaves it: the next cap removes it
        with contextlib.suppress(OSError):
            Path("/sys/fs/cgroup/blkio/draftexpert-readcap-999999").mkdir(exist_ok=True)
    try:
        cap = ReadCap(rate, probe).__enter__()
    except ReadCapError as e:  # not root, or no blkio / io controller on this machine
        pytest.skip(f"the kernel's read throttle is not available here: {e}")
    try:
        n, seconds = _odirect_read(probe)
        assert seconds >= n / rate - THROTTLE_SLICE_S, (n, seconds)
        cap.set(rate * 4)
        n, faster = _odirect_read(probe)
        assert faster < seconds and faster >= n / (rate * 4) - THROTTLE_SLICE_S
    finally:
        cap.__exit__(None, None, None)
    n, free = _odirect_read(probe)
    assert free < n / rate / 2  # uncapped again once the context is left
    assert not any(p.name.startswith("draftexpert-readcap-") for p in cap.parent.iterdir())  # stale one too
    probe.unlink()


def test_without_permission_the_cap_is_refused_not_ignored():
    """An unprivileged user gets ReadCapError naming root (the throttle needs it), never an
    uncapped run that claims a cap."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to try as an unprivileged user")
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c"]
    probe = subprocess.run(
        as_nobody + ["import bench.runs.readcap"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:  # e.g. a checkout in a 0700 temporary folder: the user cannot even start
        pytest.skip(f"an unprivileged user cannot run this checkout here: {probe.stderr.strip()[-200:]}")
    code = (
        "from pathlib import Path\nfrom bench.runs.readcap import ReadCap, ReadCapError\n"
        "try:\n    ReadCap(10**6, Path('bench')).__enter__()\n"
        "except ReadCapError as e:\n    print('refused:', e)\n"
    )
    p = subprocess.run(as_nobody + [code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("refused:") and ("root" in p.stdout or "blkio" in p.stdout), p.stdout
