"""The tokenized corpus as one small folder that travels: a machine with no package index (an
accelerator lent for minutes) trains the embedded targets from it without `bench data corpus`.

    <pack>/train.u16.xz, val.u16.xz   the token ids (uint16, little-endian), xz-compressed (~26% of raw)
    <pack>/tokenizer/                 the tokenizer they were encoded with
    <pack>/corpus_manifest.json       the corpus's manifest (sources, licences, decontamination)
    <pack>/pack.json                  tokens and sha256 of each raw split: `unpack` checks them
"""

from __future__ import annotations

import hashlib
import json
import lzma
import shutil
from pathlib import Path

SPLITS = ("train", "val")
CHUNK = 1 << 24


class PackError(ValueError):
    """A pack that is missing a file or whose contents do not match its pack.json."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def pack(data_dir: Path, corpus_dir: Path, out: Path, log=print) -> dict:
    """Compress `data_dir/{train,val}.bin` and its tokenizer, with `corpus_dir/manifest.json`, into `out`."""
    missing = [p for p in (*(data_dir / f"{s}.bin" for s in SPLITS), corpus_dir / "manifest.json") if not p.exists()]
    if missing:
        raise PackError(f"nothing to pack: {', '.join(map(str, missing))} missing (`bench data corpus`, then tokenize)")
    out.mkdir(parents=True, exist_ok=True)
    info = {"dtype": "uint16", "splits": {}}
    for split in SPLITS:
        src, dst = data_dir / f"{split}.bin", out / f"{split}.u16.xz"
        tmp = dst.with_suffix(".part")
        with open(src, "rb") as f, lzma.open(tmp, "wb", preset=6) as z:
            shutil.copyfileobj(f, z, CHUNK)
        tmp.rename(dst)
        info["splits"][split] = {
            "tokens": src.stat().st_size // 2,
            "sha256": _sha256(src),
            "xz_bytes": dst.stat().st_size,
        }
        log(f"{split}: {info['splits'][split]['tokens']:,} tokens → {dst} ({dst.stat().st_size / 2**20:.1f} MiB)")
    shutil.copytree(data_dir / "tokenizer", out / "tokenizer", dirs_exist_ok=True)
    shutil.copy2(corpus_dir / "manifest.json", out / "corpus_manifest.json")
    (out / "pack.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def unpack(pack_dir: Path, data_dir: Path, corpus_dir: Path, log=print) -> dict:
    """Write `data_dir/{train,val}.bin` + tokenizer and `corpus_dir/manifest.json` from a pack,
    checking each split's sha256; a split already there with the right hash is kept."""
    try:
        info = json.loads((pack_dir / "pack.json").read_text())
    except (OSError, ValueError) as e:
        raise PackError(f"{pack_dir}: not a corpus pack ({e}); make one with `bench data pack`") from e
    data_dir.mkdir(parents=True, exist_ok=True)
    corpus_dir.mkdir(parents=True, exist_ok=True)
    for split, meta in info["splits"].items():
        dst = data_dir / f"{split}.bin"
        if dst.exists() and _sha256(dst) == meta["sha256"]:
            continue
        tmp = dst.with_suffix(".part")
        try:
            with lzma.open(pack_dir / f"{split}.u16.xz", "rb") as z, open(tmp, "wb") as f:
                shutil.copyfileobj(z, f, CHUNK)
        except (OSError, EOFError, lzma.LZMAError) as e:
            tmp.unlink(missing_ok=True)
            raise PackError(f"{pack_dir / f'{split}.u16.xz'}: cannot be read ({e})") from e
        if _sha256(tmp) != meta["sha256"]:
            tmp.unlink()
            raise PackError(f"{pack_dir / f'{split}.u16.xz'}: its tokens do not match pack.json's sha256")
        tmp.rename(dst)
        log(f"{split}: {meta['tokens']:,} tokens → {dst}")
    shutil.copytree(pack_dir / "tokenizer", data_dir / "tokenizer", dirs_exist_ok=True)
    shutil.copy2(pack_dir / "corpus_manifest.json", corpus_dir / "manifest.json")
    return info
