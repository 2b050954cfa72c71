"""fibquant.data.bigbench: parsing and extraction on a small synthetic sdist (offline), and the
real goal_step_wikihow task (model: downloads the 358 MB sdist once)."""
from __future__ import annotations

import io
import json
import subprocess
import tarfile

import pytest

from fibquant.data import bigbench
from fibquant.data.bigbench import (SDIST_NAME, TASKS_PREFIX, MultipleChoiceExample, TaskUnavailableError,
                                    cached_tasks, load_bigbench_task, parse_task, sdist_task_names)

TOY_TASK = {
    "name": "toy",
    "examples": [
        {"input": "The sky is ", "target_scores": {"blue": 1, "green": 0, "loud": 0}},
        {"input": "2 + 2 = ", "target_scores": {"3": 0, "4": 1}},
        {"input": "free text", "target": "no scores: not multiple choice"},
    ],
}


def _write_sdist(path, tasks: dict[str, dict]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, task in tasks.items():
            data = json.dumps(task).encode()
            info = tarfile.TarInfo(f"{TASKS_PREFIX}{name}/task.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        readme = tarfile.TarInfo(f"{TASKS_PREFIX}toy/README.md")
        readme.size = 2
        tar.addfile(readme, io.BytesIO(b"hi"))


def test_parse_task_keeps_scored_examples_only():
    examples = parse_task(TOY_TASK, "toy")
    assert [e.options for e in examples] == [("blue", "green", "loud"), ("3", "4")]
    assert [e.correct_index for e in examples] == [0, 1]
    assert examples[0].target_scores == (1.0, 0.0, 0.0) and examples[0].subtask == "toy"
    assert examples[0].input == "The sky is "


def test_example_validation():
    with pytest.raises(ValueError, match=">= 2 options"):
        MultipleChoiceExample("q", ("a",), (1.0,), "t")
    with pytest.raises(ValueError, match="2 options but 3 target scores"):
        MultipleChoiceExample("q", ("a", "b"), (1.0, 0.0, 0.0), "t")
    with pytest.raises(ValueError, match="no option has a positive"):
        MultipleChoiceExample("q", ("a", "b"), (0.0, 0.0), "t")
    with pytest.raises(ValueError, match="non-empty string"):
        MultipleChoiceExample("q", ("a", ""), (1.0, 0.0), "t")
    with pytest.raises(ValueError, match="'input' and a 'target_scores'"):
        parse_task({"examples": [{"target_scores": {"a": 1, "b": 0}}]}, "t")


def test_load_from_a_cached_sdist_extracts_only_the_task(tmp_path):
    subtask = {"examples": [{"input": "Pick: ", "target_scores": {"x": 0, "y": 1}}]}
    _write_sdist(tmp_path / SDIST_NAME, {"toy": TOY_TASK, "toy/sub": subtask, "other": TOY_TASK})
    examples = load_bigbench_task("toy", cache_dir=tmp_path)
    assert [e.subtask for e in examples] == ["toy", "toy", "toy/sub"]
    assert (tmp_path / "tasks" / "toy" / "sub" / "task.json").is_file()
    assert not (tmp_path / "tasks" / "other").exists()
    assert cached_tasks(tmp_path) == ["toy"]
    assert sdist_task_names(tmp_path / SDIST_NAME) == ["other", "toy"]
    (tmp_path / SDIST_NAME).unlink()  # later calls read the extracted JSON only
    assert load_bigbench_task("toy", cache_dir=tmp_path) == examples


def test_unknown_task_and_bad_names(tmp_path):
    _write_sdist(tmp_path / SDIST_NAME, {"goal_step_wikihow": TOY_TASK})
    with pytest.raises(ValueError, match="no task 'goal_step_wikihw'.*close matches: goal_step_wikihow"):
        load_bigbench_task("goal_step_wikihw", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="task name must look like"):
        load_bigbench_task("../etc", cache_dir=tmp_path)


def test_corrupt_sdist_and_task_json_give_clear_errors(tmp_path):
    (tmp_path / SDIST_NAME).write_bytes(b"not a gzip file")
    with pytest.raises(TaskUnavailableError, match="cannot open .*delete it"):
        load_bigbench_task("toy", cache_dir=tmp_path)
    broken = tmp_path / "tasks" / "toy"
    broken.mkdir(parents=True)
    (broken / "task.json").write_text("{ half a json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_bigbench_task("toy", cache_dir=tmp_path)


def test_failed_download_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(bigbench, "_installed_pip_major", lambda: 24)
    monkeypatch.setattr(bigbench, "_run", lambda command: subprocess.CompletedProcess(
        command, 1, "", "ERROR: Could not find a version that satisfies the requirement"))
    with pytest.raises(TaskUnavailableError, match=r"Could not find a version.*pip download bigbench==1.0.0 "
                                                   r"--no-deps --no-binary :all:"):
        load_bigbench_task("goal_step_wikihow", cache_dir=tmp_path)


@pytest.mark.model
def test_real_goal_step_wikihow(goal_step_wikihow):
    examples = goal_step_wikihow
    by_subtask = {}
    for example in examples:
        by_subtask[example.subtask] = by_subtask.get(example.subtask, 0) + 1
    assert by_subtask == {"goal_step_wikihow/goal_inference": 1703, "goal_step_wikihow/step_inference": 2250,
                          "goal_step_wikihow/step_ordering": 3100}
    assert all(sorted(e.target_scores)[-1] == 1.0 and sum(e.target_scores) == 1.0 for e in examples)
    assert {len(e.options) for e in examples} <= {2, 4, 5}
    assert examples[0].input.startswith("The most reasonable goal of")
