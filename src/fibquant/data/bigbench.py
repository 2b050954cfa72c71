"""Multiple-choice tasks from the BIG-bench 1.0.0 source distribution, offline after one download.

`load_bigbench_task("goal_step_wikihow")` (our HellaSwag substitute) downloads the `bigbench`
sdist from PyPI with `pip download --no-deps --no-binary :all:` (~358 MB, Apache-2.0; never
installed) into `<cache root>/bigbench/`, extracts only the requested task's JSON files
(`bigbench/benchmark_tasks/<task>/**/task.json`) into `<cache root>/bigbench/tasks/<task>/`
and keeps the sdist, so other tasks can be extracted later without downloading again.

pip >= 26 refuses to download this sdist even with --no-deps (its metadata declares a direct
URL dependency on `bleurt`); in that case the same `pip download` is run with pip 25.2,
itself fetched as a wheel with `pip download` and run from the wheel file (`python pip.whl/pip`).

A task JSON holds `examples`, each with an `input` string and `target_scores` {option: score};
tasks with subtasks (goal_step_wikihow has goal_inference, step_inference, step_ordering) have
one task.json per subtask, and the examples of all subtasks are returned.
"""
from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from .text import cache_root

BIGBENCH_VERSION = "1.0.0"
SDIST_NAME = f"bigbench-{BIGBENCH_VERSION}.tar.gz"
TASKS_PREFIX = f"bigbench-{BIGBENCH_VERSION}/bigbench/benchmark_tasks/"
# Last pip that downloads the sdist: pip 26 rejects its direct-URL dependency on bleurt.
FALLBACK_PIP = "pip==25.2"
_TASK_NAME = re.compile(r"[a-z0-9_]+(/[a-z0-9_]+)*")


class TaskUnavailableError(RuntimeError):
    """The bigbench sdist could not be downloaded or read."""


@dataclass(frozen=True)
class MultipleChoiceExample:
    """One scored multiple-choice question.

    input: the question text (BIG-bench `input`); options: the answer strings;
    target_scores: one score per option (1 for the correct one(s), 0 otherwise);
    subtask: the task or subtask it comes from.
    """

    input: str
    options: tuple[str, ...]
    target_scores: tuple[float, ...]
    subtask: str

    def __post_init__(self) -> None:
        if not isinstance(self.input, str):
            raise ValueError(f"example input must be a string, got {type(self.input).__name__}")
        if len(self.options) < 2:
            raise ValueError(f"a multiple-choice example needs >= 2 options, got {len(self.options)}")
        if len(self.options) != len(self.target_scores):
            raise ValueError(f"{len(self.options)} options but {len(self.target_scores)} target scores")
        if not all(isinstance(option, str) and option for option in self.options):
            raise ValueError("every option must be a non-empty string")
        if max(self.target_scores) <= 0:
            raise ValueError(f"no option has a positive target score: {self.target_scores}")

    @property
    def correct_index(self) -> int:
        """Index of the highest-scored option (the first one on ties)."""
        best = max(self.target_scores)
        return self.target_scores.index(best)


def parse_task(task: dict, subtask: str) -> list[MultipleChoiceExample]:
    """Multiple-choice examples of one parsed task.json (examples without target_scores skipped)."""
    if not isinstance(task, dict):
        raise ValueError(f"task {subtask!r}: task.json must hold a JSON object, got {type(task).__name__}")
    examples = []
    for position, raw in enumerate(task.get("examples", [])):
        scores = raw.get("target_scores") if isinstance(raw, dict) else None
        if not scores:
            continue
        if not isinstance(scores, dict) or "input" not in raw:
            raise ValueError(f"task {subtask!r} example {position}: expected 'input' and a "
                             f"'target_scores' object, got keys {sorted(raw)}")
        examples.append(MultipleChoiceExample(
            input=raw["input"], options=tuple(scores), subtask=subtask,
            target_scores=tuple(float(value) for value in scores.values())))
    return examples


def parse_task_dir(task_dir: Path, name: str) -> list[MultipleChoiceExample]:
    """Examples of every task.json under `task_dir`: the task first, then its subtasks by path."""
    files = sorted(task_dir.rglob("task.json"), key=lambda p: (len(p.parts), p))  # the task, then subtasks
    if not files:
        raise ValueError(f"no task.json under {task_dir}")
    examples = []
    for path in files:
        relative = path.parent.relative_to(task_dir).as_posix()
        subtask = name if relative == "." else f"{name}/{relative}"
        try:
            task = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}); delete it to extract it again") from exc
        examples.extend(parse_task(task, subtask))
    if not examples:
        raise ValueError(f"BIG-bench task {name!r} has no multiple-choice examples (target_scores)")
    return examples


def bigbench_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir) if cache_dir is not None else cache_root() / "bigbench"


def load_bigbench_task(name: str = "goal_step_wikihow", *,
                       cache_dir: str | os.PathLike | None = None) -> list[MultipleChoiceExample]:
    """All multiple-choice examples of a BIG-bench task (and its subtasks), in file order.

    name: a task directory of bigbench/benchmark_tasks, or `task/subtask`. Downloads the
    sdist on first use (see the module docstring); raises ValueError for an unknown task and
    TaskUnavailableError (a RuntimeError) with the command to run if the download fails.
    """
    if not isinstance(name, str) or not _TASK_NAME.fullmatch(name):
        raise ValueError(f"BIG-bench task name must look like 'goal_step_wikihow' or "
                         f"'goal_step_wikihow/step_inference', got {name!r}")
    directory = bigbench_cache_dir(cache_dir)
    task_dir = directory / "tasks" / name
    if not any(task_dir.rglob("task.json")):
        extract_tasks(download_sdist(directory), [name], directory / "tasks")
    return parse_task_dir(task_dir, name)


def cached_tasks(cache_dir: str | os.PathLike | None = None) -> list[str]:
    """Tasks already extracted into the cache."""
    tasks = bigbench_cache_dir(cache_dir) / "tasks"
    return sorted(p.parent.relative_to(tasks).as_posix() for p in tasks.glob("*/task.json"))


def sdist_task_names(sdist: Path) -> list[str]:
    """Names of the top-level tasks in the sdist (reads the archive listing: a few seconds)."""
    with _open_sdist(sdist) as tar:
        return sorted({n[len(TASKS_PREFIX):].split("/")[0] for n in tar.getnames()
                       if n.startswith(TASKS_PREFIX) and n.endswith("/task.json")})


def _open_sdist(sdist: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(sdist, mode="r:gz")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise TaskUnavailableError(f"cannot open {sdist} ({exc}); delete it and run again to re-download") from exc


def extract_tasks(sdist: Path, names: list[str], dest: Path) -> None:
    """Extract the task.json files of `names` (with their subtasks) from the sdist into dest/<name>/."""
    prefixes = {name: f"{TASKS_PREFIX}{name}/" for name in names}
    found = dict.fromkeys(names, 0)
    try:
        with _open_sdist(sdist) as tar:
            all_tasks = set()
            for member in tar:
                if not (member.isfile() and member.name.startswith(TASKS_PREFIX)
                        and member.name.endswith("/task.json")):
                    continue
                all_tasks.add(member.name[len(TASKS_PREFIX):].split("/")[0])
                for name, prefix in prefixes.items():
                    if member.name.startswith(prefix):
                        target = dest / name / member.name[len(prefix):]
                        target.parent.mkdir(parents=True, exist_ok=True)
                        partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
                        partial.write_bytes(tar.extractfile(member).read())
                        partial.replace(target)
                        found[name] += 1
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise TaskUnavailableError(f"cannot read {sdist} ({exc}); delete it and run again to re-download") from exc
    for name, count in found.items():
        if count == 0:
            close = difflib.get_close_matches(name.split("/")[0], sorted(all_tasks), n=5)
            raise ValueError(f"BIG-bench {BIGBENCH_VERSION} has no task {name!r} ({len(all_tasks)} tasks; "
                             f"close matches: {', '.join(close) or 'none'})")


def _pip_download_command(pip: list[str], directory: Path) -> list[str]:
    return [*pip, "download", f"bigbench=={BIGBENCH_VERSION}", "--no-deps", "--no-binary", ":all:",
            "--disable-pip-version-check", "-d", str(directory)]


def download_sdist(directory: Path) -> Path:
    """`directory/bigbench-1.0.0.tar.gz`, downloaded with pip if absent (~358 MB, ~1 minute)."""
    sdist = directory / SDIST_NAME
    if sdist.is_file():
        return sdist
    directory.mkdir(parents=True, exist_ok=True)
    print(f"fibquant: downloading the bigbench {BIGBENCH_VERSION} sdist (~358 MB) into {directory}",
          file=sys.stderr)
    result = None
    if _installed_pip_major() < 26:  # newer pip downloads 358 MB and then rejects it: skip straight on
        result = _run(_pip_download_command([sys.executable, "-m", "pip"], directory))
    if result is None or (result.returncode != 0 and "direct URL dependencies" in result.stderr):
        wheel = _fallback_pip_wheel(directory / "tools")
        result = _run(_pip_download_command([sys.executable, str(wheel / "pip")], directory))
    if result.returncode != 0 or not sdist.is_file():
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise TaskUnavailableError(
            f"cannot download the bigbench {BIGBENCH_VERSION} sdist ({last}); run "
            f"`{sys.executable} -m pip download bigbench=={BIGBENCH_VERSION} --no-deps --no-binary :all: "
            f"-d {directory}` (with pip < 26) and try again")
    return sdist


def _installed_pip_major() -> int:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("pip").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return 0


def _fallback_pip_wheel(tools: Path) -> Path:
    wheels = sorted(tools.glob("pip-*.whl"))
    if not wheels:
        tools.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", FALLBACK_PIP, "--no-deps", "--only-binary", ":all:",
              "--disable-pip-version-check", "-d", str(tools)])
        wheels = sorted(tools.glob("pip-*.whl"))
    if not wheels:
        raise TaskUnavailableError(f"pip >= 26 cannot download the bigbench sdist and {FALLBACK_PIP} could not "
                                   f"be fetched; run `{sys.executable} -m pip download {FALLBACK_PIP} --no-deps "
                                   f"-d {tools}`")
    return wheels[-1]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    """Run pip; its progress output goes to the terminal, its errors are captured for the message."""
    try:
        progress = sys.stderr if sys.stderr.fileno() >= 0 else None
    except (AttributeError, OSError, ValueError):  # a replaced stream (pytest capture, notebooks)
        progress = None
    try:
        return subprocess.run(command, stdout=progress, stderr=subprocess.PIPE, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(command, 1, "", str(exc))
