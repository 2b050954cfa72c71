"""Loading a script of benchmarks/ or tools/ as a module, for the tests of its pure parts (tables, comparisons)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
TOOLS = ROOT / "tools"


def load_script(folder: Path, name: str) -> ModuleType:
    """<folder>/<name>.py as the module `name`, once per process (the folder on sys.path, so a script
    that imports a sibling script finds it)."""
    if name in sys.modules:
        return sys.modules[name]
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a failed load is not cached
        raise
    return module


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module."""
    return load_script(BENCHMARKS, name)


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py as a module."""
    return load_script(TOOLS, name)
