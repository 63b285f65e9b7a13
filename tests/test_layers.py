"""Imports point down only: every ``gradsync`` import (module level or inside a function) goes to the
importing module's own layer or a lower one of the table in ``gradsync/__init__.py``'s docstring."""

import ast
from pathlib import Path

import gradsync

SRC = Path(gradsync.__file__).parent


def layers() -> dict[str, int]:
    """Top-level module or package -> layer (0 = bottom), from the docstring's table."""
    doc = gradsync.__doc__
    table = doc[doc.index("Layers, top to bottom"):].split("::\n\n", 1)[1].split("\n\n", 1)[0]
    rows = [line.strip().split("  ", 1)[0] for line in table.splitlines() if line.strip()]
    return {name.strip(): len(rows) - 1 - i for i, row in enumerate(rows) for name in row.split(",")}


def top_level(path: Path) -> str:
    return path.relative_to(SRC).with_suffix("").parts[0]


def imported(path: Path, source: str) -> list[tuple[int, str]]:
    """``(line, top-level gradsync module)`` of every gradsync import in ``source`` (file ``path``)."""
    package = path.relative_to(SRC).with_suffix("").parts[:-1]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            names = [*base, *(node.module.split(".") if node.module else [])]
            if not names:  # "from . import x" in gradsync/__init__.py: x is the top-level module
                names = [node.names[0].name]
            out.append((node.lineno, names[0]))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradsync."):
            out.append((node.lineno, node.module.split(".")[1]))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[1]) for a in node.names if a.name.startswith("gradsync.")]
    return out


def upward_imports(path: Path, source: str, table: dict[str, int]) -> list[str]:
    me = top_level(path)
    return [f"{path.relative_to(SRC)}:{line} ({me}, layer {table[me]}) imports {mod} (layer {table[mod]})"
            for line, mod in imported(path, source) if mod != me and table[mod] > table[me]]


def test_every_module_is_in_the_table_and_no_import_points_up():
    table = layers()
    files = sorted(SRC.rglob("*.py"))
    assert {top_level(f) for f in files} <= set(table), set(map(top_level, files)) - set(table)
    bad = [msg for f in files for msg in upward_imports(f, f.read_text(), table)]
    assert not bad, "imports pointing up a layer:\n" + "\n".join(bad)


def test_the_check_sees_an_upward_import():
    table = layers()
    assert table["algorithms"] < table["profiler"] and table["compressors"] < table["comm"]
    path = SRC / "algorithms" / "synchroniser.py"
    assert upward_imports(path, "def f():\n    from ..profiler.ccr import measure_ccr\n", table)
    assert upward_imports(path, "import gradsync.train.loop\n", table)
    assert not upward_imports(path, "from ..comm.buckets import ddp_bucket_numels\nfrom .base import HookState\n",
                              table)
    assert upward_imports(SRC / "compressors" / "base.py", "from ..feedback import residual\n", table)
