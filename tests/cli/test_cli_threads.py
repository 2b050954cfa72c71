"""`--threads` on every command that runs torch work, through one helper (fibquant.cli._threads)."""
from __future__ import annotations

import argparse
import os

import pytest
import torch

from fibquant.cli import build_parser
from fibquant.cli._threads import add_threads_argument, apply_threads, default_threads

EVAL_COMMANDS = ("rate-distortion", "canonical-source", "fidelity", "perplexity", "multiple-choice", "archive-bench", "decode-speed")


def _eval_subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    evals = next(a for a in top.choices["eval"]._actions if isinstance(a, argparse._SubParsersAction))
    return dict(evals.choices)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_is_half_the_cores_at_most_8(monkeypatch):
    for cores, expected in ((None, 1), (1, 1), (2, 1), (4, 2), (16, 8), (64, 8)):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        assert default_threads() == expected


@pytest.mark.parametrize("argv", [["demo"], *(["eval", name] for name in EVAL_COMMANDS)],
                         ids=lambda argv: " ".join(argv))
def test_every_torch_command_accepts_threads(argv):
    parser = build_parser()
    args = parser.parse_args([*argv, "--threads", "3"])
    assert args.threads == 3
    assert parser.parse_args(argv).threads is None  # resolved to default_threads() when applied


def test_no_eval_command_lacks_threads():
    for name, sub in _eval_subcommands(build_parser()).items():
        assert any("--threads" in a.option_strings for a in sub._actions), f"fibquant eval {name} has no --threads"
    assert set(EVAL_COMMANDS) <= set(_eval_subcommands(build_parser()))


def test_apply_sets_torch_threads_and_reports(restore_threads, capsys):
    parser = argparse.ArgumentParser()
    add_threads_argument(parser)
    assert apply_threads(parser.parse_args(["--threads", "2"])) == 2
    assert torch.get_num_threads() == 2
    assert "threads: 2" in capsys.readouterr().err
    assert apply_threads(parser.parse_args([])) == default_threads()
    assert torch.get_num_threads() == default_threads()
    assert f"threads: {default_threads()}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--threads must be >= 1"):
        apply_threads(parser.parse_args(["--threads", "0"]))


def test_cli_commands_reject_bad_thread_counts_before_loading(capsys):
    from fibquant.cli import main

    assert main(["eval", "decode-speed", "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
    assert main(["eval", "perplexity", "--threads", "-1"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
