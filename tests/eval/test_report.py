"""fibquant.paths, fibquant.eval.report and fibquant.eval.timing: one results rule, one table,
one figure preamble, one experiment registry; reports of the converted experiments offline."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fibquant import paths
from fibquant.eval import report, timing
from fibquant.eval.report import EXPERIMENTS, Experiment, format_table, format_targets, get_experiment, target


def test_paths_follow_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FIBQUANT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FIBQUANT_RESULTS_DIR", str(tmp_path / "res"))
    assert paths.cache_root() == tmp_path / "cache"
    assert paths.results_root() == tmp_path / "res" and not (tmp_path / "res").exists()
    assert paths.results_dir(None, "archive") == tmp_path / "res" / "archive"
    assert (tmp_path / "res" / "archive").is_dir()
    assert paths.results_dir(tmp_path / "given") == tmp_path / "given"
    monkeypatch.delenv("FIBQUANT_CACHE_DIR")
    monkeypatch.delenv("FIBQUANT_RESULTS_DIR")
    assert paths.cache_root() == Path.home() / ".cache" / "fibquant"
    assert paths.results_root() == Path("results")


def test_every_cache_reader_uses_the_one_root(tmp_path, monkeypatch):
    from fibquant.codebook.store import cache_dir
    from fibquant.data.bigbench import bigbench_cache_dir
    from fibquant.data.text import text_cache_dir

    monkeypatch.setenv("FIBQUANT_CACHE_DIR", str(tmp_path))
    assert (cache_dir(), text_cache_dir(), bigbench_cache_dir()) == (
        tmp_path / "codebooks", tmp_path / "text", tmp_path / "bigbench")


def test_format_table_plain_and_markdown():
    rows = [{"name": "a", "x": 1.23456, "n": 3}, {"name": "bb", "x": None, "n": 10}]
    columns = [("name", "name", ""), ("x", "x", ".2f"), ("n", "count", "d")]
    assert format_table(rows, columns).splitlines() == [
        "name |    x | count", "-----+------+------", "a    | 1.23 |     3", "bb   |    - |    10"]
    assert format_table(rows, columns, markdown=True).splitlines() == [
        "| name | x | count |", "|---|---|---|", "| a | 1.23 | 3 |", "| bb | - | 10 |"]


def test_format_targets_states_met_missed_and_unjudged():
    text = format_targets([target("ratio <= 0.85", 0.8, True, "k=4"), target("mse <= 0.5", 0.61234, False),
                           target("best any", "12.00x (INT4)", None)])
    assert text.splitlines() == ["  [met] ratio <= 0.85: measured 0.8 (k=4)", "  [MISSED] mse <= 0.5: measured 0.6123",
                                 "  [n/a] best any: measured 12.00x (INT4)"]


def test_figure_saves_and_closes_and_saves_nothing_on_error(tmp_path):
    plt = report.pyplot()
    with report.figure(tmp_path / "a.png", figsize=(2, 2)) as (fig, ax):
        ax.plot([0, 1], [1, 0])
    assert (tmp_path / "a.png").stat().st_size > 1000 and not plt.fignum_exists(fig.number)
    with pytest.raises(RuntimeError), report.figure(tmp_path / "b.png") as (fig, ax):
        raise RuntimeError("drawing failed")
    assert not (tmp_path / "b.png").exists() and not plt.fignum_exists(fig.number)


def _tiny_experiment(**changes) -> Experiment:
    def plot(payload, path):
        with report.figure(path, figsize=(2, 2)) as (fig, ax):
            ax.bar([r["name"] for r in payload["rows"]], [r["x"] for r in payload["rows"]])

    fields = dict(name="tiny", stem="tiny", config=dict, run=lambda config: {"rows": [{"name": "a", "x": 1.0}]},
                  columns=[("name", "name", ""), ("x", "x", ".1f")], plot=plot,
                  targets=lambda p: [target("x >= 1", p["rows"][0]["x"], p["rows"][0]["x"] >= 1)])
    return Experiment(**{**fields, **changes})


def test_experiment_main_prints_and_writes_under_the_results_env_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FIBQUANT_RESULTS_DIR", str(tmp_path))
    payload = _tiny_experiment(table_suffix=".md").main()
    out = capsys.readouterr().out
    assert "a    | 1.0" in out and "[met] x >= 1: measured 1" in out and "wrote" in out
    assert json.loads((tmp_path / "tiny.json").read_text()) == payload
    assert (tmp_path / "tiny.png").stat().st_size > 1000
    assert (tmp_path / "tiny.md").read_text() == "name |   x\n-----+----\na    | 1.0\n"
    files = _tiny_experiment(plot_suffix="_frontier.png").report(payload, tmp_path / "other", echo=False)
    assert Path(files["png"]).name == "tiny_frontier.png" and capsys.readouterr().out == ""


def test_registry_resolves_every_experiment_and_rejects_unknown_names():
    for name in EXPERIMENTS:
        experiment = get_experiment(name)
        assert experiment.name == name and experiment.stem and callable(experiment.run)
        assert experiment.config().__class__ is experiment.config  # defaults construct
    with pytest.raises(ValueError, match="unknown experiment 'nope'"):
        get_experiment("nope")


def test_timing_helpers():
    calls = []
    seconds, result = timing.best_of(lambda: calls.append(1) or len(calls), 3)
    assert result == 3 and seconds >= 0 and len(calls) == 3
    with timing.Stopwatch() as watch:
        pass
    assert 0 <= watch.seconds == watch.seconds  # stopped: no longer advancing
    assert timing.median_us([1e-6, 3e-6, 2e-6]) == pytest.approx(2.0)
    assert timing.rate(2.0, 10) == 5.0 and timing.rate(0.0, 10) == float("inf")
    with pytest.raises(ValueError, match="repeats"):
        timing.best_of(lambda: None, 0)


def test_demo_header_names_the_text_author_and_window():
    from fibquant.eval.demo import DemoConfig, demo_header

    perplexity = {"model": "m", "tokens": 2048, "windows": 4, "model_dtype": "float32",
                  "exact_window": {"sink_tokens": 2, "recent_tokens": 16}}
    header = demo_header(DemoConfig(text="moby_dick", sink_tokens=2, recent_tokens=16), perplexity)
    assert "moby_dick (Herman Melville, Debian r-cran-tokenizers)" in header
    assert "exact window 2 sinks + 16 recent" in header and "Austen" not in header
    emma = demo_header(DemoConfig(), {**perplexity, "exact_window": {"sink_tokens": 4, "recent_tokens": 32}})
    assert "emma (Jane Austen, Debian r-cran-janeaustenr)" in emma and "4 sinks + 32 recent" in emma
    assert "'stored' the window and code rows alone" in emma  # the two bytes columns are told apart


def test_needle_report_from_a_payload(tmp_path, capsys):
    from fibquant.kv.specs import parse_cache_specs
    from fibquant.eval.needle import EXPERIMENT, NeedleConfig, needle_targets, summarise

    config = NeedleConfig(lengths=(1024,), depths=(0.0, 1.0), keys_per_cell=1)
    trials = [{"cache": s, "length": 1024, "depth": d, "rep": 0, "correct": True}
              for s in ("fp", "int:b=4") for d in (0.0, 1.0)]
    rows = summarise(trials, parse_cache_specs("fp;int:b=4"), config, 64)
    payload = {"model": "m", "text": "emma", "rows": rows, "skipped": ["quanto:b=2: not installed"],
               "config": {"lengths": [1024], "depths": [0.0, 1.0], "keys_per_cell": 1, "seed": 0, "sink_tokens": 4,
                          "recent_tokens": 32, "max_new_tokens": 8, "attention": "codes"},
               "targets": needle_targets(rows)}
    files = EXPERIMENT.report(payload, tmp_path)
    out = capsys.readouterr().out
    assert "INT4" in out and "skipped: quanto:b=2" in out
    assert "[MISSED] best FibQuant ratio with fp-equal retrieval (target >= 10x): measured None" in out
    assert Path(files["json"]).name == "needle.json" and Path(files["png"]).stat().st_size > 1000


def test_archive_kv_report_writes_the_study_plot_beside_the_ttft_plot(tmp_path):
    import dataclasses

    from fibquant.eval.archive.kv import EXPERIMENT
    from fibquant.eval.archive.study import STUDY_COLUMNS, study_table

    row = {key: 1 for key, _, _ in STUDY_COLUMNS} | {"name": "hybrid K4/V2 per-head", "group": "hybrid",
                                                      "ratio_marginal": 40.0, "perplexity_change_pct": 5.0}
    payload = {"config": {}, "parts": ["ttft", "study"], "study": {"rows": [row]},
               "prefix_ttft": {"ttft_fp_s": 1.0, "ttft_cold_s": 1.5, "ttft_warm_s": 0.2, "prompt_tokens": 40,
                               "reused_tokens": 32}}
    assert study_table([row]).splitlines()[0].startswith("| configuration | K B/vec |")
    files = dataclasses.replace(EXPERIMENT, stem="kv_run").report(payload, tmp_path, echo=False)
    assert Path(files["png"]).name == "kv_run.png" and (tmp_path / "kv_run_study.png").stat().st_size > 1000
    assert "study" in json.loads((tmp_path / "kv_run.json").read_text())


def test_archive_kv_targets_judge_each_part_present():
    from fibquant.eval.archive.kv import archive_kv_targets

    payload = {"store_8k": {"open_ms_median": 10.0, "token_read_us_median_warm": 70.0,
                            "token_read_us_median_cold": 60.0, "disk_over_memory": 1.004,
                            "token_read_mismatches_vs_codec_decode": 0},
               "study": {"verdict": {"ratio_marginal": {"met": False, "best": None}}}}
    met = {t["target"]: t["met"] for t in archive_kv_targets(payload)}
    assert met["open an 8k-token saved cache <= 50 ms"] and met["on-disk <= 1.02x in-memory code bytes"]
    assert not met["read one token's K/V <= 50 us (median, warm)"]
    assert met["a hybrid at >= 36x vs fp16 below +11.2 % perplexity (ratio_marginal)"] is False
    assert archive_kv_targets({}) == []


def test_write_json_writes_non_finite_numbers_as_null(tmp_path):
    import numpy as np
    import torch

    from fibquant.eval.report import write_json

    payload = {"nan": float("nan"), "inf": float("inf"), "rows": [{"x": np.float32("nan"), "y": -np.inf},
               (1.5, torch.tensor(float("nan")))], "ok": np.float64(0.25), "n": np.int64(3), "flag": True}
    text = write_json(tmp_path / "r.json", payload).read_text()

    def reject(token):
        raise AssertionError(f"{token} is not valid JSON")
    assert json.loads(text, parse_constant=reject) == {
        "nan": None, "inf": None, "rows": [{"x": None, "y": None}, [1.5, None]], "ok": 0.25, "n": 3, "flag": True}
