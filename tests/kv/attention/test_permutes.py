"""The in-register decode of 4-bit codes into 16 scalar codewords (`intrinsics._build_permutes`) in
each of its instruction variants (AVX-512 permute, AVX2 permutes + blend, the generic gather), each
where this CPU runs it, against a numpy decode-then-dot."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from fibquant.kv.attention.intrinsics import _build_permutes, _target_features  # noqa: E402

VARIANTS = {"avx512": {"avx512f", "avx2"}, "avx2": {"avx2"}, "generic": set()}


def _decoded(codewords, rows, dim):
    """rows uint8 [n, 2 + dim / 2] -> [n, dim]: field p = nibble p of the payload, the low one first."""
    payload = rows[:, 2:2 + dim // 2]
    fields = np.stack([payload & 15, payload >> 4], axis=-1).reshape(len(rows), dim)
    return codewords[fields, 0]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dim, heads, n", [(64, 3, 37), (64, 1, 16), (128, 4, 21), (64, 2, 5), (64, 3, 48)])
def test_permute_variants_equal_numpy(variant, dim, heads, n):
    if not VARIANTS[variant] <= _target_features():
        pytest.skip(f"this CPU has no {variant}")
    from numba import njit

    scores_fn, values_fn = _build_permutes(VARIANTS[variant])
    vecs = dim // 16

    @njit
    def run(codewords, rows, query, res, wts, acc):
        scores_fn(codewords, rows, rows.shape[0], vecs, heads, query, 1, res)
        values_fn(codewords, rows, rows.shape[0], vecs, heads, wts, acc, 1)

    rng = np.random.default_rng(dim + heads + n)
    codewords = np.sort(rng.standard_normal((16, 1)).astype(np.float32), axis=0)
    block = rng.integers(0, 256, size=(n, 2 + dim // 2 + 3), dtype=np.uint8)  # 3 pad bytes: strided rows
    rows = block[:, :2 + dim // 2]
    query = rng.standard_normal((heads + 2, dim)).astype(np.float32)
    # fp16 norms in bytes 0-1, converted by the intrinsics: normals, a zero, a subnormal, a negative
    norms16 = (rng.random(n) * 100 + 0.5).astype(np.float16)
    norms16[:3] = [0.0, 6e-8, -1.5]
    block[:, :2] = norms16.view(np.uint8).reshape(n, 2)
    norms = norms16.astype(np.float32)
    step = 2 if n > 16 else 1  # n > 16: scores into a strided view (the 16-token stores lane by lane)
    res_full = np.full((heads + 1, step * (n + 4)), 7.0, dtype=np.float32)
    res = res_full[:, ::step]
    wts = rng.random((heads, n)).astype(np.float32)
    if n > 16:  # weights as a strided view: the values' 16-token groups load them lane by lane
        wts = np.repeat(wts, 2, axis=1)[:, ::2]
    acc = rng.standard_normal((heads + 2, dim)).astype(np.float32)
    start = acc.copy()
    run(codewords, rows, query, res[:, 2:2 + n], wts, acc)
    x = _decoded(codewords, rows, dim).astype(np.float64)
    want_scores = norms[None, :] * (query[1:1 + heads].astype(np.float64) @ x.T)
    # float32 sums in another order than numpy's float64: rounding relative to the largest term
    np.testing.assert_allclose(res[:heads, 2:2 + n], want_scores, rtol=1e-5, atol=1e-5 * np.abs(want_scores).max())
    untouched = np.ones(res_full.shape, dtype=bool)
    untouched[:heads, (2 + np.arange(n)) * step] = False
    assert (res_full[untouched] == 7).all()  # nothing else written
    want_acc = start[1:1 + heads] + (wts * norms[None, :]) @ x
    np.testing.assert_allclose(acc[1:1 + heads], want_acc, rtol=1e-5, atol=1e-5 * np.abs(want_acc).max())
    np.testing.assert_array_equal(acc[0], start[0])
    np.testing.assert_array_equal(acc[1 + heads:], start[1 + heads:])
