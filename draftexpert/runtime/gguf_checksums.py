"""Per-tensor sha256 sidecars of the GGUF files this suite writes (expert files, llama.cpp heads).

Integrity: every file this module's writers produce has a sidecar `<file>.sha256.json` with the
sha256 of each tensor's bytes, written when the file is complete (a file without it is
unfinished). `verify_checksums` reads the tensors back and compares; it records the file's
size, mtime and inode when they match, so the next open checks only those (cheap) and reads
everything again only when the file has changed since — or when asked (`full=True`, what
`bench convert --verify` does).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import gguf
import numpy as np


def digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).view(np.uint8).reshape(-1)).hexdigest()


def add_tensor(w, digests: dict[str, str], name: str, arr: np.ndarray, raw_dtype=None) -> None:
    """GGUFWriter.add_tensor, remembering the sha256 of the bytes it will write."""
    arr = np.ascontiguousarray(arr)
    digests[name] = digest(arr)
    w.add_tensor(name, arr, raw_dtype=raw_dtype) if raw_dtype is not None else w.add_tensor(name, arr)


def checksum_path(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + ".sha256.json")


def _stamp(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def finish_atomic(w, tmp: Path, path: Path, digests: dict[str, str]) -> Path:
    """Write a GGUFWriter's file to `tmp`, move it to `path` in one step, then its checksums."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return publish(tmp, path, digests)


def publish(tmp: Path, path: Path, digests: dict[str, str]) -> Path:
    """Move a finished file into place, then write its checksums."""
    checksum_path(path).unlink(missing_ok=True)  # until the new sidecar exists the file counts as unfinished
    os.replace(tmp, path)
    _write_sidecar(path, {"algorithm": "sha256", "tensors": digests, "verified": _stamp(path)})
    return path


def _write_sidecar(path: Path, data: dict) -> None:
    side = checksum_path(path)
    tmp = side.with_name(f".{side.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, side)
    finally:
        tmp.unlink(missing_ok=True)


def verify_checksums(path: Path, full: bool = False) -> str | None:
    """None when `path` matches its checksums, else what is wrong. Without `full`, a file
    unchanged (size, mtime, inode) since it was last verified is not read again."""
    path = Path(path)
    side = checksum_path(path)
    try:
        data = json.loads(side.read_text())
        digests = data["tensors"]
    except (OSError, ValueError, KeyError):
        return f"it has no readable checksum file {side.name} (an unfinished or older file)"
    if not full and data.get("verified") == _stamp(path):
        return None
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - a damaged header raises ValueError/struct.error/IndexError
        return f"its header is not readable GGUF ({type(e).__name__})"
    found = {t.name: t for t in reader.tensors}
    del reader
    if set(found) != set(digests):
        return f"it holds other tensors than were written ({len(found)} vs {len(digests)})"
    size = path.stat().st_size
    with open(path, "rb", buffering=0) as f:
        for name, t in found.items():
            if t.data_offset + t.n_bytes > size:
                return f"it is truncated (tensor {name} ends past the end)"
            h, left = hashlib.sha256(), int(t.n_bytes)
            f.seek(t.data_offset)
            while left:
                chunk = f.read(min(left, 1 << 24))
                if not chunk:
                    return f"it is truncated (tensor {name})"
                h.update(chunk)
                left -= len(chunk)
            if h.hexdigest() != digests[name]:
                return f"tensor {name} does not match its checksum (damaged bytes)"
    data["verified"] = _stamp(path)
    try:
        _write_sidecar(path, data)
    except OSError:
        pass  # a read-only cache only costs the full check next time
    return None
