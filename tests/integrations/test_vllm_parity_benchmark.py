"""benchmarks/vllm_parity.py's comparison of two engines' per-span NLLs, without an engine (no vLLM needed)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _benchmarks import load_benchmark



@pytest.fixture(scope="module")
def bench():
    return load_benchmark("vllm_parity")


def _run(engine, dtype, base, coded, offsets=(10, 20), recent=32):
    return {"engine": engine, "dtype": dtype, "offsets": list(offsets), "tokens": 512, "chunk": 32, "sinks": 4,
            "recent": recent, "nll": {"uncompressed": list(base), "fibquant:b=2": list(coded)}}


def test_compare_gives_span_and_pooled_differences_in_points(bench, tmp_path, capsys):
    first = _run("transformers", "float32", [2.0, 3.0], [2.1, 3.2])
    second = _run("vllm", "bfloat16", [2.0, 3.1], [2.2, 3.1], recent=31)
    paths = []
    for name, run in (("a.json", first), ("b.json", second)):
        paths.append(str(tmp_path / name))
        Path(paths[-1]).write_text(json.dumps(run))
    bench.main(["--compare", *paths])
    lines = capsys.readouterr().out.splitlines()
    assert "transformers float32" in lines[0] and "vllm bfloat16 (4+31 exact)" in lines[0]
    spans = [line.split("|") for line in lines[2:4]]
    for cells, (a, b) in zip(spans, [(0.1, 0.2), (0.2, 0.0)]):
        want = 100 * ((math.exp(b) - 1) - (math.exp(a) - 1))
        assert float(cells[5]) == pytest.approx(want, abs=1e-3)
    pooled = 100 * ((math.exp(0.1) - 1) - (math.exp(0.15) - 1))  # mean NLL gaps: 0.15 and 0.1
    assert f"**{pooled:+.3f}**" in lines[4]


def test_compare_refuses_runs_of_different_spans(bench):
    with pytest.raises(ValueError, match="different spans"):
        bench._compare(_run("transformers", "float32", [2.0, 3.0], [2.1, 3.2]),
                       _run("vllm", "float32", [2.0, 3.0], [2.1, 3.2], offsets=(10, 30)))
