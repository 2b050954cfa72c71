"""README.md and the guides in docs/ name only what exists: repository paths, `fibquant.x.y` modules and
attributes, `fibquant <command>` CLI commands and `from fibquant import ...` names; their measured tables
are what tools/readme_tables.py renders from the committed results/*.json. The logs in docs/notes/ are
records of past runs and are not checked."""
from __future__ import annotations

import argparse
import importlib
import re
import subprocess
from pathlib import Path

import pytest
from _benchmarks import load_tool

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# `data/` is left out: the docs also name files inside Debian's R packages (data/Rdata.rdb)
PACKAGE_DIRS = {"fibquant", "codebook", "codecs", "archive", "peers", "kv", "eval", "integrations", "cli"}
FILE_SUFFIXES = {"py", "md", "sh", "json", "toml", "txt", "safetensors", "gguf", "png"}
TOP_DIRS = {"src", "tests", "benchmarks", "tools", "docs", "results", ".ci"}

CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)
# a path with a folder, or a bare source file name (outputs such as peers.json are not checked)
PATH = re.compile(r"(?<![\w./~$-])((?:[\w.-]+/)+[\w.-]*|[\w-]+\.(?:py|sh))(?![\w/{<*-])")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
DOTTED = re.compile(r"(?<![\w.])fibquant(?:\.\w+)+")
FROM_IMPORT = re.compile(r"^\s*from (fibquant[\w.]*) import \(?([\w ,]+)\)?", re.M)
COMMAND = re.compile(r"(?:^|(?<=[\s/`]))fibquant ((?:[a-z][\w-]*)(?:\|[a-z][\w-]*)*)"
                     r"(?: ((?:[a-z][\w-]*)(?:\|[a-z][\w-]*)*))?", re.M)


def _code(text: str) -> str:
    return "\n".join(match.group(0).strip("`") for match in CODE.finditer(text))


def _tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.split())


def _path_exists(token: str, page: Path, tracked_names: set[str]) -> bool:
    """A file or folder from the root, the page, src/ or the package; `kv/specs.CacheSpec` and
    `kv/attention/kernels` name a module (and an attribute); a bare `name.py` is some tracked file."""
    token = token.rstrip(".")
    if "/" not in token:
        return token in tracked_names or (page.parent / token).exists()
    head, _, last = token.rstrip("/").rpartition("/")
    stem, dot, suffix = last.partition(".")
    forms = [token.rstrip("/")]
    if not dot or suffix not in FILE_SUFFIXES:
        forms += [f"{head}/{stem}.py", f"{head}/{stem}"]
    bases = [ROOT, page.parent, ROOT / "src", ROOT / "src" / "fibquant"]
    return any((base / form).exists() for base in bases for form in forms)


def _links(page: Path) -> set[str]:
    """Relative markdown links, which resolve against the page's folder."""
    return {m.group(1) for m in LINK.finditer(page.read_text()) if "://" not in m.group(1)}


def _paths(page: Path) -> set[str]:
    """Paths named in code spans and blocks: from the root, the page, src/ or the package."""
    found = set()
    for match in PATH.finditer(_code(page.read_text())):
        token = match.group(1)
        if any(c in token for c in "<>*{}") or token.startswith(("results/", ".venv", "http")):
            continue  # placeholders and outputs of a run
        first = token.split("/")[0]
        if "/" in token and first not in TOP_DIRS | PACKAGE_DIRS:
            continue  # another tree (a user's directory, /tmp, a package's own files)
        found.add(token)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_path_exists(page):
    tracked = _tracked()
    names = {Path(p).name for p in tracked}
    missing = sorted(t for t in _paths(page) if not _path_exists(t, page, names))
    missing += sorted(link for link in _links(page) if not (page.parent / link).exists())
    assert missing == [], f"{page.name} names paths that do not exist: {missing}"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_module_and_imported_name_exists(page):
    text = page.read_text()
    names = set(DOTTED.findall(_code(text)))
    for module, imported in FROM_IMPORT.findall(text):
        names |= {f"{module}.{name}" for name in re.split(r"[,\s]+", imported) if name}
    missing = sorted(n for n in names if not _resolves(n))
    assert missing == [], f"{page.name} names modules or attributes that do not exist: {missing}"


def _choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser] | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_cli_command_exists(page):
    from fibquant.cli import build_parser

    top = _choices(build_parser())
    missing = []
    for command, sub in COMMAND.findall(_code(page.read_text())):
        for name in command.split("|"):
            if name == "import":
                continue
            if name not in top:
                missing.append(name)
                continue
            below = _choices(top[name])
            for part in (sub.split("|") if sub and below else []):
                if part not in below:
                    missing.append(f"{name} {part}")
    assert missing == [], f"{page.name} names CLI commands that do not exist: {missing}"


def test_the_checks_catch_what_is_gone():
    """The patterns find a missing path, module, name and command (the checks above are not vacuous)."""
    page = ROOT / "README.md"
    assert not _path_exists("src/fibquant/kv/codes.py", page, set())
    assert not _path_exists("coded_numba.py", page, {"cache.py"})
    assert _path_exists("kv/cache.py", page, set()) and _path_exists("kv/specs.CacheSpec", page, set())
    assert _path_exists("kv/", page, set()) and not _path_exists("kv/persist_read", page, set())
    assert not _resolves("fibquant.kv.persist_read") and _resolves("fibquant.kv.cache.CompressedCache")
    text = "`fibquant eval nope` and `fibquant archive pack|gone` `kv/attention.py` `from fibquant import X`"
    found = [match for match in COMMAND.findall(_code(text)) if match[0] != "import"]
    assert found == [("eval", "nope"), ("archive", "pack|gone")]
    assert "kv/attention.py" in {m.group(1) for m in PATH.finditer(_code(text))}


def test_readme_tables_equal_the_committed_results():
    tables = load_tool("readme_tables")
    for name, (path, _) in tables.TABLES.items():
        if not (ROOT / path).exists():
            pytest.skip(f"{path} is not in this checkout")
    for page in tables.pages():
        text = page.read_text()
        assert tables.refresh(text) == text, f"{page.name}: run python tools/readme_tables.py"


def test_readme_is_a_product_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", readme), "no dated runs in the README"
    assert "<!-- table:codes -->" in readme
