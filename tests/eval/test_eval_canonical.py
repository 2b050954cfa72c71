"""fibquant.eval.canonical_source: KS statistics on synthetic data (offline) and on real keys (model)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scipy import stats

from fibquant.eval.canonical_source import (CanonicalConfig, cached_states, canonical_ks, ks_statistic, run_canonical,
                                     save_canonical, uniform_floor, unit_rows)
from fibquant.canonical import block_radii, haar_rotation, sample_sphere


def test_ks_statistic_is_small_on_exact_beta_samples_and_large_otherwise():
    dim, k = 64, 4
    exact = torch.from_numpy(stats.beta(k / 2, (dim - k) / 2).rvs(20_000, random_state=0))
    assert ks_statistic(exact, dim, k) < 0.015
    assert ks_statistic(torch.full((1000,), 0.5), dim, k) > 0.9


def test_rotation_canonicalises_anisotropic_vectors():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 64, generator=gen, dtype=torch.float64)
    x[:, :3] *= 25.0  # three outlier channels, like real keys
    ks = canonical_ks(x, (1, 2, 8), haar_rotation(64, seed=0))
    for k, row in ks.items():
        assert row["unrotated"] > 0.3, (k, row)
        assert row["rotated"] < row["unrotated"] / 3, (k, row)


def test_uniform_vectors_pass_with_or_without_rotation():
    u = sample_sphere(4000, 64, seed=5, dtype=torch.float64)
    ks = canonical_ks(u, (1, 4), haar_rotation(64, seed=0))
    floor = uniform_floor(4000, 64, (1, 4), seed=0)
    for k in (1, 4):
        assert ks[k]["unrotated"] < 0.02 and ks[k]["rotated"] < 0.02 and floor[k] < 0.02


def test_unit_rows_and_config_validation():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    assert torch.equal(unit_rows(x), torch.tensor([[0.6, 0.8], [0.0, 0.0]]))
    assert block_radii(unit_rows(x), 1).tolist() == pytest.approx([0.36, 0.64, 0.0, 0.0])
    with pytest.raises(ValueError, match="tokens must be an integer >= 2"):
        CanonicalConfig(tokens=1)
    with pytest.raises(ValueError, match="block_sizes must be positive"):
        CanonicalConfig(block_sizes=(0,))
    with pytest.raises(ValueError, match="layers must be a non-empty"):
        CanonicalConfig(layers=())


@pytest.mark.model
def test_real_keys_are_far_more_canonical_after_rotation(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    config = CanonicalConfig(tokens=256, layers=(0, 15), block_sizes=(1, 4))
    payload = run_canonical(model, tokenizer, config, progress=False)
    assert payload["head_dim"] == 64 and payload["layers"] == [0, 15]
    assert len(payload["rows"]) == 2 * 2 * 2
    for row in payload["rows"]:
        assert row["vectors"] == 3 * 256  # 3 KV heads pooled
        assert row["ks_rotated"] < row["ks_unrotated"], row
        if row["kind"] == "keys":  # RoPE'd keys have strong outlier channels
            assert row["ks_unrotated"] > 0.05 and row["ks_rotated"] < row["ks_unrotated"] / 3, row
    paths = save_canonical(payload, tmp_path)
    assert Path(paths["png"]).stat().st_size > 10_000 and Path(paths["json"]).is_file()
    with pytest.raises(ValueError, match="out of range"):
        cached_states(model, torch.tensor([1, 2, 3]), (30,))
