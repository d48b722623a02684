"""Print the test catalogue: every module under tests/ with the first line of its docstring.

    python tests/catalogue.py          # file: summary, one line per module
    python tests/catalogue.py --full   # each module's whole docstring

Read with `ast`, so nothing is imported or run; the name does not start with test_, so pytest does
not collect it. No tests here.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def catalogue(full: bool = False) -> list[str]:
    """`path: first docstring line` (or the whole docstring) for every module, test modules first."""
    files = sorted(TESTS.rglob("*.py"), key=lambda p: (not p.name.startswith("test_"), str(p)))
    lines = []
    for path in files:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "(no docstring)"
        name = path.relative_to(TESTS.parent).as_posix()
        lines.append(f"{name}:\n{doc}\n" if full else f"{name}: {doc.splitlines()[0]}")
    return lines


if __name__ == "__main__":
    print("\n".join(catalogue(full="--full" in sys.argv[1:])))
