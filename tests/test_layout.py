"""Layouts kept true: the tests' own (shared helpers in tests/helpers.py, no file imports a test
file) and docs/design.md's account of the package (its layer picture, the files it names).

A test file imported by another runs its module-level code twice (under two names) and ties one
file's tests to another's internals; what several files need belongs in helpers.py. A design
document that names files no longer there, or misses new ones, misleads the next reader.
"""

from __future__ import annotations

import ast
import re
import tomllib
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


# --- docs/design.md stays true to the package ----------------------------------------------------
# Its opening picture is the import-linter layers contract of pyproject.toml, one line per layer;
# its "What lives where" section names every module where it is (the convention is stated in a
# comment at the top of that section, and read here by `named_paths`).

ROOT = TESTS.parent
PACKAGE = ROOT / "pufferfish"
ROOTED = ("pufferfish/", "benchmarks/", "tests/", "docs/")  # paths given from the repository


def picture_layers(design: str) -> list[set[str]]:
    """The layers of design.md's first code block: each line's first column (before two spaces),
    ``a | b`` siblings, ``dir/`` a package and ``file.py`` a module, as dotted module names."""
    block = re.search(r"^```\n(.*?)^```", design, re.S | re.M)
    assert block, "docs/design.md opens with no code block (the layer picture)"
    layers = []
    for line in block.group(1).splitlines():
        column = re.split(r"\s{2,}", line.strip())[0]
        names = (name.strip().rstrip("/").removesuffix(".py") for name in column.split("|"))
        layers.append({f"pufferfish.{name}" for name in names})
    return layers


def contract_layers() -> list[set[str]]:
    """The layers contract of pyproject.toml, each layer a set of modules."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [layers] = [c["layers"] for c in config["tool"]["importlinter"]["contracts"]
                if c["type"] == "layers"]
    return [{name.strip() for name in layer.split("|")} for layer in layers]


def section(design: str, title: str) -> str:
    """The text of the ``## title`` section, its HTML comments removed."""
    start = design.index(f"\n## {title}\n")
    end = design.find("\n## ", start + 1)
    return re.sub(r"<!--.*?-->", "", design[start:None if end < 0 else end], flags=re.S)


def named_paths(text: str, root: Path) -> list[Path]:
    """Every path a "What lives where" text names: a backticked ``x.py`` is a file of the package
    its nearest ``###``/``####`` heading names (``bench/``; none: the top level), a backticked path
    with a slash is relative to the package root, or to ``root`` when it starts with one of
    ``ROOTED``; the headings' package directories are named paths too."""
    package, base, found = root / "pufferfish", root / "pufferfish", []
    for line in text.splitlines():
        tokens = re.findall(r"`([\w./-]+)`", line)
        if re.match(r"#{3,4} ", line):
            dirs = [t for t in tokens if t.endswith("/")]
            base = package / dirs[0] if dirs else package
            found += [base] if dirs else []
        for token in tokens:
            if token.startswith(ROOTED):
                found.append(root / token)
            elif token.endswith(".py"):
                found.append((package if "/" in token else base) / token)
    return found


def modules(package: Path) -> set[Path]:
    """Every module file of ``package``, but ``__init__.py`` and ``__main__.py``."""
    return {p for p in package.rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}


def test_the_picture_is_the_layers_contract() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    assert picture_layers(design) == contract_layers()


def test_every_path_design_names_exists_and_every_module_is_named() -> None:
    text = section((ROOT / "docs" / "design.md").read_text(), "What lives where")
    named = named_paths(text, ROOT)
    missing = sorted(str(p.relative_to(ROOT)) for p in named if not p.exists())
    assert not missing, f"docs/design.md names what does not exist: {missing}"
    unnamed = sorted(str(p.relative_to(ROOT)) for p in modules(PACKAGE) - set(named))
    assert not unnamed, f"docs/design.md's 'What lives where' does not name: {unnamed}"


def test_names_resolve_by_heading_and_a_moved_file_is_caught(tmp_path: Path) -> None:
    for path in ("pufferfish/cli.py", "pufferfish/bench/step.py", "pufferfish/training/step.py",
                 "pufferfish/training/checkpoint/ranks.py", "benchmarks/sweep.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    text = ("### `cli.py`\n- `cli.py`: parsing\n### `bench/`\n- `step.py`, not `training/step.py`\n"
            "#### `training/checkpoint/`\n- `ranks.py`, `benchmarks/sweep.py`\n")
    named = named_paths(text, tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in named] == [
        "pufferfish/cli.py", "pufferfish/cli.py", "pufferfish/bench",
        "pufferfish/bench/step.py", "pufferfish/training/step.py",
        "pufferfish/training/checkpoint", "pufferfish/training/checkpoint/ranks.py",
        "benchmarks/sweep.py"]
    assert modules(tmp_path / "pufferfish") <= set(named)
    (tmp_path / "pufferfish/bench/step.py").rename(tmp_path / "pufferfish/bench/worker.py")
    assert tmp_path / "pufferfish/bench/worker.py" in modules(tmp_path / "pufferfish") - set(named)
    assert not (tmp_path / "pufferfish/bench/step.py").exists()
