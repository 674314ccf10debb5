"""docs/DESIGN.md's dependency rule, checked on every import of every module (module-level or inside a
function): the library never imports the harness, figures never run a model, the round knows no engine,
the runtime uses nothing else of the library, AR offload only the contracts, and the harness's jobs
point one way (commands → steps → cells → runs → suites)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (importing package, imported prefix): never
NEVER = [
    ("draftexpert", "bench"),
    ("draftexpert", "baselines"),
    ("draftexpert", "paper_figs"),
    ("paper_figs", "draftexpert.runtime"),
    ("paper_figs", "draftexpert.engines"),
    ("paper_figs", "draftexpert.speculation"),
    ("paper_figs", "draftexpert.training"),
    ("paper_figs", "baselines"),
    ("paper_figs", "torch"),
    ("paper_figs", "bench"),
    ("draftexpert.speculation", "draftexpert.runtime"),
    ("draftexpert.speculation", "draftexpert.engines"),
    ("draftexpert.speculation", "draftexpert.training"),
    ("draftexpert.runtime", "draftexpert.speculation"),
    ("draftexpert.runtime", "draftexpert.engines"),
    ("draftexpert.runtime", "draftexpert.training"),
    ("draftexpert.runtime", "draftexpert.decoding"),
    ("draftexpert.runtime", "draftexpert.metrics"),
    ("draftexpert.decoding", "draftexpert."),
    ("draftexpert.metrics", "draftexpert."),
    ("baselines", "draftexpert.runtime"),
    ("baselines", "draftexpert.engines"),
    ("baselines", "draftexpert.speculation"),
    ("baselines", "bench"),
    # bench by job: cli → steps → cells → runs → suites; tiny → suites; only the CLI imports the CLI
    *[(src, "bench.cli") for src in ("bench.steps", "bench.cells", "bench.runs", "bench.suites", "bench.tiny")],
    *[(src, "bench.steps") for src in ("bench.cells", "bench.runs", "bench.suites", "bench.tiny")],
    *[(src, "bench.cells") for src in ("bench.runs", "bench.suites", "bench.tiny")],
    *[(src, "bench.runs") for src in ("bench.suites", "bench.tiny")],
    ("bench.suites", "bench.tiny"),
]


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = ROOT) -> set[str]:
    """Every module a file imports, wherever the import stands (relative imports resolved)."""
    name, out = module_name(path, root), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def within(name: str, prefix: str) -> bool:
    return name == prefix.rstrip(".") or name.startswith(prefix if prefix.endswith(".") else prefix + ".")


def violations(files, root: Path = ROOT) -> list[str]:
    found = []
    for f in files:
        mod = module_name(f, root)
        for src, dst in NEVER:
            if not within(mod, src):
                continue
            found += [
                f"{mod} imports {i} (never {src} → {dst})"
                for i in sorted(imports(f, root))
                if within(i, dst) and not within(i, src)
            ]
    return found


def test_dependency_rule_holds():
    files = [f for d in ("draftexpert", "paper_figs", "baselines", "bench") for f in (ROOT / d).rglob("*.py")]
    assert len(files) > 20
    assert violations(files) == []


def test_the_check_catches_a_broken_arrow(tmp_path):
    """An import from the round to the runtime — inside a function, relative — is reported."""
    f = tmp_path / "draftexpert" / "speculation" / "bad.py"
    f.parent.mkdir(parents=True)
    f.write_text("def g():\n    from ..runtime import model\n    return model\n")
    assert violations([f], tmp_path) == [
        "draftexpert.speculation.bad imports draftexpert.runtime (never draftexpert.speculation → draftexpert.runtime)",
        "draftexpert.speculation.bad imports draftexpert.runtime.model "
        "(never draftexpert.speculation → draftexpert.runtime)",
    ]


@pytest.mark.parametrize(
    "mod, imported, broken",
    [
        ("draftexpert.engines.x", "bench.cells.cell", True),
        ("draftexpert.engines.x", "draftexpert.runtime", False),
        ("paper_figs.fig2", "draftexpert.metrics", False),
    ],
)
def test_rule_table(mod, imported, broken):
    assert any(within(mod, s) and within(imported, d) and not within(imported, s) for s, d in NEVER) is broken
