"""The public API (`fibquant.__init__`) covers what the README and docs import, grouped by area."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import fibquant

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(set(fibquant.__all__) - {"__version__"}))
def test_every_public_name_resolves(name):
    assert getattr(fibquant, name) is not None


def test_dir_lists_the_public_names_and_unknown_names_fail():
    assert set(fibquant.__all__) <= set(dir(fibquant))
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
        fibquant.no_such_thing


def test_areas_cover_the_persistence_api_the_readme_advertises():
    areas = {area: {n for names in modules.values() for n in names} for area, modules in fibquant._AREAS.items()}
    assert {"PersistentCache", "save_cache", "load_cache", "generate_persistent", "resume_generate",
            "prefill_with_prefix"} <= areas["persistence"]
    assert {"CompressedCache", "attention_on_codes", "choose_code", "parse_cache_spec", "build_cache",
            "AttentionNotOnCodes"} <= areas["caches"]
    assert {"E8ShellCodec", "FibRVQCodec"} <= areas["codecs"]


def _imported_names(text: str) -> set[tuple[str, str]]:
    out = set()
    for module, names in re.findall(r"^\s*from (fibquant[\w.]*) import ([\w ,()]+)$", text, flags=re.M):
        for name in re.split(r"[,\s()]+", names):
            if name:
                out.add((module, name))
    return out


def test_every_import_in_readme_and_docs_resolves():
    import importlib
    import warnings

    found = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found |= _imported_names(path.read_text())
    assert ("fibquant", "CompressedCache") in found
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the docs use the current names
        missing = [f"{m}.{n}" for m, n in sorted(found) if not hasattr(importlib.import_module(m), n)]
    assert missing == []
