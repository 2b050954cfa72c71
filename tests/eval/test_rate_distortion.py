"""Library side of the rate-distortion benchmark: grid, MSE helper, target bookkeeping."""
import json

import pytest

from fibquant.codecs import TurboQuantCodec
from fibquant.codecs.fibquant import choose_block
from fibquant.eval.rate_distortion import (FOR_RATE_GRID, RDConfig, fibquant_grid, format_report, unit_mse,
                                           write_outputs)
from _rd_helpers import rd_report as _report
from fibquant.canonical import sample_sphere


def test_quick_grid_is_the_for_rate_table_and_full_grid_adds_block_sizes():
    quick = fibquant_grid(64, quick=True)
    assert set(quick) == {choose_block(64, b) for b in FOR_RATE_GRID}
    full = fibquant_grid(64, quick=False)
    assert set(quick) < set(full)
    assert (4, 16) in full and (2, 16) in full  # 1 and 2 bits with smaller k
    assert all(64 % k == 0 and 4 <= n <= 4096 for k, n in full)


def test_unit_mse_matches_direct_computation():
    codec = TurboQuantCodec(32, 2)
    u = sample_sphere(3000, 32, seed=1)
    direct = float(((codec.roundtrip(u) - u).double() ** 2).sum(1).mean())
    assert unit_mse(codec, u, batch=700) == pytest.approx(direct, rel=1e-9)


def test_targets_are_judged_on_the_measured_numbers(tmp_path):
    good = {t["target"]: t["met"] for t in _report(0.08, 0.5).targets}
    bad = {t["target"]: t["met"] for t in _report(0.09, 0.2).targets}
    key = "FibQuant/TurboQuant MSE at b=2 <= 0.85"
    assert good[key] and not bad[key]
    assert not good["FibQuant MSE at b=0.5 <= 0.57"]
    assert good["FibQuant/TurboQuant encode throughput at b=2 >= 0.3"]
    assert not bad["FibQuant/TurboQuant encode throughput at b=2 >= 0.3"]
    report = _report(0.08, 0.5)
    text = format_report(report)
    assert "MISSED" in text and "FibQuant*" in text
    json_path, png_path = write_outputs(report, tmp_path / "out")
    assert json.loads(json_path.read_text())["points"][0]["mse"] == 0.08
    assert png_path.stat().st_size > 1000


def test_config_validation():
    with pytest.raises(ValueError, match="dims"):
        RDConfig(dims=(1,))
    with pytest.raises(ValueError, match="n_vectors"):
        RDConfig(n_vectors=10)
    with pytest.raises(ValueError, match="max_codewords"):
        RDConfig(max_codewords=1)


def test_max_codewords_limits_the_fibquant_grid():
    from fibquant.eval.rate_distortion import run_rate_distortion

    config = RDConfig(dims=(64,), n_vectors=256, throughput_vectors=256, throughput_repeats=1,
                      quick=True, build_missing=False, max_codewords=256)
    report = run_rate_distortion(config)
    sizes = {p.n_codewords for p in report.points if p.codec.lower().startswith("fibquant")}
    assert sizes and max(sizes) <= 256  # the shipped N=1024/4096 codebooks are left out
