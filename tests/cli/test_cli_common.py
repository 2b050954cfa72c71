"""Shared CLI arguments (fibquant.cli._common), the results directory rule, and loud registration."""
from __future__ import annotations

import json

import pytest

import fibquant.cli as cli
from fibquant.cli import build_parser, main
from fibquant.cli._common import split_specs


def test_split_specs_accepts_semicolons_and_spaces():
    assert split_specs("fp;int:b=4  turboquant:b=2;") == ["fp", "int:b=4", "turboquant:b=2"]
    assert split_specs("fibquant:k=64,n=4096") == ["fibquant:k=64,n=4096"]


SPEC_COMMANDS = (["eval", "fidelity"], ["eval", "perplexity"], ["eval", "multiple-choice"], ["eval", "needle"], ["eval", "decode-speed"],
                 ["eval", "peers"])


@pytest.mark.parametrize("argv", SPEC_COMMANDS, ids=" ".join)
def test_spec_lists_take_both_separators_everywhere(argv):
    parser = build_parser()
    spaced = parser.parse_args([*argv, "--caches", "fp", "int:b=4"]).caches
    semicolons = parser.parse_args([*argv, "--caches", "fp;int:b=4"]).caches
    mixed = parser.parse_args([*argv, "--caches", "fp;", "int:b=4"]).caches
    assert spaced == semicolons == mixed == ["fp", "int:b=4"]


def test_empty_spec_list_is_an_argument_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "needle", "--caches", ";"])
    assert "--caches needs at least one value" in capsys.readouterr().err


def test_build_parser_fails_loudly_on_a_missing_command_module(monkeypatch):
    monkeypatch.setattr(cli, "_COMMAND_MODULES", (*cli._COMMAND_MODULES, "fibquant.cli.no_such_module"))
    with pytest.raises(ImportError, match="fibquant.cli.no_such_module"):
        build_parser()


def test_build_parser_rejects_a_module_without_register(monkeypatch):
    monkeypatch.setattr(cli, "_COMMAND_MODULES", ("fibquant.cli._threads",))
    with pytest.raises(TypeError, match="neither register nor register_eval"):
        build_parser()


def test_eval_rd_writes_to_the_results_env_dir(tmp_path, monkeypatch, capsys):
    from _rd_helpers import rd_report as _report

    import fibquant.eval.rate_distortion as rd

    seen = []
    monkeypatch.setattr(rd, "run_rate_distortion", lambda config: seen.append(config) or _report(0.08, 0.5))
    monkeypatch.setenv("FIBQUANT_RESULTS_DIR", str(tmp_path / "env"))
    assert main(["eval", "rate-distortion", "--quick", "--vectors", "512", "--threads", "1"]) == 0
    assert seen[0].n_vectors == 512 and seen[0].quick and not seen[0].build_missing
    payload = json.loads((tmp_path / "env" / "rate_distortion.json").read_text())
    assert payload["points"][0]["mse"] == 0.08
    assert (tmp_path / "env" / "rate_distortion.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "FibQuant*" in out and "[MISSED] FibQuant MSE at b=0.5 <= 0.57" in out
    assert main(["eval", "rate-distortion", "--quick", "--out", str(tmp_path / "given"), "--threads", "1"]) == 0
    assert (tmp_path / "given" / "rate_distortion.json").is_file()


def test_eval_archive_out_defaults_to_the_results_env_dir(tmp_path, monkeypatch):
    import fibquant.cli.archive as archive_cli

    calls = []
    monkeypatch.setattr(archive_cli, "run_experiment", lambda name, config, out_dir: calls.append(out_dir))
    monkeypatch.setenv("FIBQUANT_RESULTS_DIR", str(tmp_path))
    assert main(["eval", "archive-bench", "--quick", "--threads", "1"]) == 0
    monkeypatch.delenv("FIBQUANT_RESULTS_DIR")
    assert main(["eval", "archive-bench", "--quick", "--threads", "1"]) == 0
    assert main(["eval", "archive-bench", "--quick", "--out", str(tmp_path / "x"), "--threads", "1"]) == 0
    assert [str(c) for c in calls] == [str(tmp_path / "archive"), "results/archive", str(tmp_path / "x")]


def test_number_and_name_lists_take_commas_and_spaces():
    parser = build_parser()
    for argv in (["0,7", "15"], ["0", "7", "15"], ["0;7;15"]):
        assert parser.parse_args(["eval", "fidelity", "--layers", *argv]).layers == [0, 7, 15]
        assert parser.parse_args(["eval", "canonical-source", "--layers", *argv]).layers == [0, 7, 15]
    args = parser.parse_args(["eval", "archive-kv", "--parts", "ttft,search", "--search-sizes", "100", "200"])
    assert args.parts == ["ttft", "search"] and args.search_sizes == [100, 200]
    assert parser.parse_args(["eval", "needle", "--depths", "0,0.5"]).depths == [0.0, 0.5]
    assert parser.parse_args(["eval", "rate-distortion", "--dims", "64,128"]).dims == [64, 128]


def test_bad_list_values_are_argument_errors(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "canonical-source", "--layers", "0,x"])
    assert "--layers: expected int values" in capsys.readouterr().err


def test_unknown_archive_kv_part_fails_before_loading_the_model(capsys):
    assert main(["eval", "archive-kv", "--parts", "ttft,nope", "--threads", "1"]) == 2
    assert "unknown parts ['nope']" in capsys.readouterr().err


def test_old_experiment_names_are_gone(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "rd"])
    assert "invalid choice" in capsys.readouterr().err


def test_experiment_name_module_stem_and_benchmark_agree():
    from pathlib import Path

    from fibquant.eval.report import EXPERIMENTS, get_experiment

    benchmarks = {p.stem for p in (Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py")}
    for name, module in EXPERIMENTS.items():
        assert module.split(".")[-1] in (name.replace("-", "_"), name.split("-")[-1]), (name, module)
        stem = get_experiment(name).stem
        if isinstance(stem, str):
            assert stem == name.replace("-", "_"), (name, stem)
        if name != "demo":  # `make demo` / `fibquant demo` is its entry point
            assert name.replace("-", "_") in benchmarks, name
