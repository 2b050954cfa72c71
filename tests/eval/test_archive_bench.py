"""The benchmark library runs end to end on a tiny configuration (table, JSON, plot)."""
import json

import pytest

import numpy as np

from fibquant.eval.archive.baselines import BenchmarkCheckError, check_lookups, search_quality
from fibquant.eval.archive.bench import EXPERIMENT, BenchConfig, run


def test_tiny_benchmark_writes_every_method_and_labels_the_text_fallback(tmp_path, capsys):
    config = BenchConfig(n_symbols=3000, alphabets=(16, 4096), lookups=200, zstd_lookups=20, appends=500,
                         append_chunk=100, queries=20, recall_queries=5, search_sizes=(3000,), zstd_frame=1024,
                         text_names=(), repeats=1)
    report = EXPERIMENT.main(config, tmp_path)
    saved = json.loads((tmp_path / "archive_bench.json").read_text())
    assert set(saved) == {"config", "targets", "machine", "results", "target_check"}
    assert (tmp_path / "archive_bench.png").stat().st_size > 10_000
    table = (tmp_path / "archive_bench.md").read_text()
    assert "| stream | N | method" in table and "| stream | method | bits | encode |" in table
    methods = {(r["stream"], r["method"]) for r in saved["results"]}
    for stream in ("uniform-16", "zipf-16", "uniform-4096", "zipf-4096", "text-256"):
        for method in ("fractal-exact", "fractal-float", "raw-numpy", "bitpack", "zstd-3", "zstd-19",
                       "sorted-keys", "suffix-array"):
            assert (stream, method) in methods
    text_notes = {r["note"] for r in saved["results"] if r["stream"] == "text-256"}
    assert len(text_notes) == 1 and text_notes.pop().startswith("FALLBACK")  # never silently synthetic
    searched = [r for r in saved["results"] if "recall_1e3" in r]
    # Recall and precision are measured for every search method, baselines included.
    assert {r["method"] for r in searched} == {"fractal-exact", "fractal-float", "sorted-keys", "suffix-array"}
    assert all(r["recall_1e3"] == 1.0 and r["precision_1e3"] == 1.0 for r in searched)
    assert all(r["recall_batched_1e3"] == r["precision_batched_1e3"] == 1.0
               for r in searched if r["method"].startswith("fractal"))
    exact = [r for r in saved["results"] if r["method"] == "fractal-exact" and r["stream"] == "uniform-4096"][0]
    assert exact["bits_per_symbol"] < 1.1 * 12
    out = capsys.readouterr().out
    assert report["target_check"] and "Targets" in out
    assert "fractal-exact uniform-16: encode_us <= 0.0068" in out and "recall >= 1.0" in out
    assert len(EXPERIMENT.target_list(report)) == len(report["target_check"])


def test_run_returns_the_payload_without_writing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = BenchConfig(n_symbols=1000, alphabets=(16,), lookups=50, zstd_lookups=10, appends=100,
                         append_chunk=50, queries=5, recall_queries=2, search_sizes=(1000,), zstd_frame=512,
                         text_names=(), repeats=1)
    payload = run(config, variants=("exact",), progress=False)
    assert {r["method"] for r in payload["results"]} >= {"fractal-exact", "raw-numpy"}
    assert "fractal-float" not in {r["method"] for r in payload["results"]}
    assert list(tmp_path.iterdir()) == []


def test_config_validation():
    with pytest.raises(ValueError, match="search size"):
        BenchConfig(n_symbols=1000, search_sizes=(5000,))


def test_search_quality_reports_missed_and_spurious_hits():
    symbols = np.array([1, 2, 1, 2, 1, 2, 3])
    queries = [np.array([1, 2])]  # true end positions 1, 3, 5
    assert search_quality(lambda q: np.array([1, 3, 5]), symbols, queries) == (1.0, 1.0)
    assert search_quality(lambda q: np.array([1, 5]), symbols, queries) == (2 / 3, 1.0)
    assert search_quality(lambda q: np.array([1, 3, 5, 6]), symbols, queries) == (1.0, 0.75)


def test_wrong_lookups_raise_an_explicit_error():
    symbols = np.arange(10)
    check_lookups("identity", lambda i: i, symbols, list(range(10)))
    with pytest.raises(BenchmarkCheckError, match="off-by-one: 10 of 10 lookups"):
        check_lookups("off-by-one", lambda i: i + 1, symbols, list(range(10)))
