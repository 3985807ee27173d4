"""The tests' own layout: shared helpers live in tests/helpers.py, and no file imports a test file.

A test file imported by another runs its module-level code twice (under two names) and ties one
file's tests to another's internals; what several files need belongs in helpers.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_test_modules(source: str, test_modules: set[str]) -> list[str]:
    """The modules of ``test_modules`` that ``source`` imports, at any depth (function bodies
    too), as ``import x``, ``import x as y`` or ``from x import y``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [name for name in names if name.split(".")[0] in test_modules]
    return found


def test_the_scan_finds_every_form_of_import() -> None:
    source = ("import test_a\nimport test_b as b\nfrom test_c import x\nimport helpers\n"
              "def f():\n    from conftest import y\n")
    modules = {"test_a", "test_b", "test_c", "conftest"}
    assert imported_test_modules(source, modules) == ["test_a", "test_b", "test_c", "conftest"]


def test_no_file_in_tests_imports_a_test_file_or_conftest() -> None:
    files = sorted(TESTS.glob("*.py"))
    test_modules = {p.stem for p in files if p.stem.startswith("test_")} | {"conftest"}
    assert "test_training" in test_modules and (TESTS / "helpers.py").exists()
    offenders = {p.name: found for p in files
                 if (found := imported_test_modules(p.read_text(), test_modules))}
    assert not offenders, f"import shared helpers from tests/helpers.py instead: {offenders}"
