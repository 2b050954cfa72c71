"""The E8 shell-code decode step (kv/attention/numba_shells.py: per-query tables over the compact tables' halves
at b <= 2, each block decoded in the kernel above) against the torch path on decoded floats and the spec (decode
every code, one softmax), to float32 tolerance; the block decoders (codebook/e8shell_tables.py `point_py` through
`point_tables`, `compact_point_py` through `compact_point_tables`) equal to `unrank` exactly, and the compact
tables' words naming each point's halves."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from _kv_helpers import check_sinks_and_sliding_window, ragged_float_mask, decode_all_attention, fast_and_torch_paths, filled_coded_layer

import fibquant.kv.attention.numba_shells as numba_shells
from fibquant.codebook.e8shell import shell_size, shell_tables, unrank
from fibquant.codebook.e8shell_tables import (COMPACT_MAX_POINTS, CompactPointTables, ShellPointTables,
                                              compact_point_tables, decode_points, point_tables)
from fibquant.codecs.e8shell import E8ShellCodec, shipped_levels
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.fibrvq import FibRVQCodec
from fibquant.codecs.reader import ShellsReader
from fibquant.kv.attention import attend_codes
from fibquant.kv.cache import CompressedLayer

pytest.importorskip("numba")

DIM = 64
PAIRS = {
    "e8 2/2": lambda: (E8ShellCodec(DIM, 2), E8ShellCodec(DIM, 2)),
    "e8 3/3 nc": lambda: (E8ShellCodec(DIM, 3, norm_correction=True), E8ShellCodec(DIM, 3, norm_correction=True)),
    "e8 4/2": lambda: (E8ShellCodec(DIM, 4), E8ShellCodec(DIM, 2)),
    "e8 2/4 r3": lambda: (E8ShellCodec(DIM, 2, rotation_seed=3), E8ShellCodec(DIM, 4)),
    "e8 1.75/1 nc": lambda: (E8ShellCodec(DIM, 1.75, norm_correction=True), E8ShellCodec(DIM, 1)),
    "e8 1.5/2": lambda: (E8ShellCodec(DIM, 1.5), E8ShellCodec(DIM, 2)),
}


@functools.lru_cache(maxsize=None)
def codecs_of(pair):
    return PAIRS[pair]()


@pytest.fixture
def shell_calls(monkeypatch):
    calls = []
    original = numba_shells.attend_decode_shells
    monkeypatch.setattr(numba_shells, "attend_decode_shells", lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.parametrize("bits", [1, 1.5, 1.75, 2, 3, 4])
def test_decoded_blocks_equal_unrank_exactly(bits):
    """Every index up to 2 bits, every orbit's first and last index and random ones at 3 and 4 bits: the
    decomposed tables give unrank's float64 point rounded to float32, bit for bit."""
    levels = shipped_levels(DIM, bits)
    tables, ptables = shell_tables(levels), point_tables(levels)
    rng = np.random.default_rng(int(4 * bits))
    index = np.arange(tables.count) if bits <= 2 else rng.integers(0, tables.count, 100_000)
    index = np.concatenate([index, ptables.starts[:-1], ptables.starts[1:] - 1])
    got = decode_points(index, ptables)
    want = unrank(index, tables).astype(np.float32)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
    with pytest.raises(ValueError, match="out of range"):
        decode_points(np.array([tables.count]), ptables)
    with pytest.raises(ValueError, match="out of range"):
        decode_points(np.array([-1]), ptables)


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("groups", [1, 3, 6])  # 6 query heads per KV head
@pytest.mark.parametrize("masked", [False, True])
def test_shell_step_equals_torch_path_and_spec(monkeypatch, shell_calls, pair, groups, masked):
    batch, heads = 2, 2
    layer, generator = filled_coded_layer(*codecs_of(pair), batch, heads, past=70)
    kv, _ = layer.update(torch.randn(batch, heads, 1, DIM, generator=generator),
                         torch.randn(batch, heads, 1, DIM, generator=generator))
    query = torch.randn(batch, heads * groups, 1, DIM, generator=generator)
    mask = None
    if masked:
        mask = ragged_float_mask(batch, heads * groups, kv.length, generator)
    fast, slow = fast_and_torch_paths(query, kv, mask, 0.125)
    assert shell_calls, "the shell kernel did not run"
    assert fast.shape == (batch, 1, heads * groups, DIM) and fast.dtype == query.dtype
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast, decode_all_attention(query, kv, mask, 0.125), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("past", [1, 17, 300])
def test_shell_step_lengths_sinks_centring_window(monkeypatch, shell_calls, past):
    """Several lengths (one coded row up to a few hundred), learned sinks, centred keys/values, the exact
    sinks + window of the layer, a sliding window over the row."""
    layer, generator = filled_coded_layer(*codecs_of("e8 3/3 nc"), 2, 3, past=past + 12, centre=True)
    assert layer.key_mean is not None
    kv, _ = layer.update(torch.randn(2, 3, 1, DIM, generator=generator) + 1.0,
                         torch.randn(2, 3, 1, DIM, generator=generator) + 1.0)
    assert kv.num_coded > 0 and kv.num_sink == 4
    query = torch.randn(2, 9, 1, DIM, generator=generator)
    sinks = torch.randn(9, generator=generator)
    check_sinks_and_sliding_window(query, kv, sinks, window=max(2, kv.length - 10))
    assert len(shell_calls) == 2


def test_bad_codes_raise(monkeypatch):
    """An index beyond the code's points (4 bits: 2^31.95 points in 32 bits) is a ValueError, not garbage."""
    layer, generator = filled_coded_layer(*codecs_of("e8 4/2"), 1, 1, past=30)
    kv, _ = layer.update(torch.randn(1, 1, 1, DIM, generator=generator), torch.randn(1, 1, 1, DIM, generator=generator))
    kv.key_codes[0, 0, 3, 2:6] = 255  # index 2^32 - 1 >= count
    with pytest.raises(ValueError, match="beyond their code's points"):
        attend_codes(torch.randn(1, 2, 1, DIM, generator=generator), kv, None, 0.125)


@pytest.mark.parametrize("role", ["keys", "values"])
def test_bad_compact_codes_raise(shell_calls, role):
    """The compact path (2 bits: 65 520 points in 16 bits) flags index 65 535 in either role."""
    layer, generator = filled_coded_layer(*codecs_of("e8 2/2"), 1, 1, past=30)
    kv, _ = layer.update(torch.randn(1, 1, 1, DIM, generator=generator), torch.randn(1, 1, 1, DIM, generator=generator))
    (kv.key_codes if role == "keys" else kv.value_codes)[0, 0, 5, 4:6] = 255
    with pytest.raises(ValueError, match="hold 1 index"):
        attend_codes(torch.randn(1, 6, 1, DIM, generator=generator), kv, None, 0.125)  # 6 query heads: 2 passes
    assert shell_calls


@pytest.mark.parametrize("groups", [3, 6])
def test_shell_step_d128(monkeypatch, shell_calls, groups):
    """d = 128 (16 blocks a row): compact keys (2 bits) with decomposed values (3 bits), and the reverse."""
    for key_bits, value_bits in ((2, 3), (3, 1.75)):
        layer, generator = filled_coded_layer(E8ShellCodec(128, key_bits), E8ShellCodec(128, value_bits), 1, 2, past=40)
        kv, _ = layer.update(torch.randn(1, 2, 1, 128, generator=generator),
                             torch.randn(1, 2, 1, 128, generator=generator))
        query = torch.randn(1, 2 * groups, 1, 128, generator=generator)
        fast, slow = fast_and_torch_paths(query, kv, None, 0.09)
        torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    assert len(shell_calls) == 2


def test_what_the_shell_kernel_does_not_take(monkeypatch, shell_calls):
    """One role not a shell code, > 8 query heads per KV head, a prefill chunk: other paths (still = the spec)."""
    assert numba_shells.shell_plan(FibQuantCodec(DIM, 4, 256)) is None
    assert numba_shells.shell_plan(FibRVQCodec(DIM, stages=2)) is None
    mixed = CompressedLayer(E8ShellCodec(DIM, 2), FibQuantCodec(DIM, 4, 256), 4, 8, attention="codes")
    generator = torch.Generator().manual_seed(1)
    for chunk in (20, 1):
        kv, _ = mixed.update(torch.randn(1, 1, chunk, DIM, generator=generator),
                             torch.randn(1, 1, chunk, DIM, generator=generator))
    query = torch.randn(1, 2, 1, DIM, generator=generator)
    torch.testing.assert_close(attend_codes(query, kv, None, 0.125), decode_all_attention(query, kv, None, 0.125),
                               rtol=1e-4, atol=1e-5)
    layer, generator = filled_coded_layer(*codecs_of("e8 2/2"), 1, 1, past=30)
    kv, _ = layer.update(torch.randn(1, 1, 1, DIM, generator=generator), torch.randn(1, 1, 1, DIM, generator=generator))
    query = torch.randn(1, 9, 1, DIM, generator=generator)
    torch.testing.assert_close(attend_codes(query, kv, None, 0.125), decode_all_attention(query, kv, None, 0.125),
                               rtol=1e-4, atol=1e-5)
    chunk = torch.randn(1, 2, 20, DIM, generator=generator)
    kv, _ = layer.update(chunk[:, :1], chunk[:, 1:])
    attend_codes(torch.randn(1, 2, 20, DIM, generator=generator), kv, None, 0.125)
    assert not shell_calls


@pytest.mark.parametrize("bits", [2, 3])
def test_shell_layout_matches_the_codec(bits):
    """ShellsReader: decoding a code by hand from its tables and rotation gives the codec's decode."""
    codec = E8ShellCodec(DIM, bits, norm_correction=True)
    x = torch.randn(5, DIM, generator=torch.Generator().manual_seed(3))
    codes = codec.encode(x)
    shells = codec.reader(torch.device("cpu"))
    assert isinstance(shells, ShellsReader)
    raw = codes[:, 2:].to(torch.int64).reshape(5, DIM // 8, shells.index_bits // 8)
    index = (raw << (8 * torch.arange(shells.index_bits // 8))).sum(-1)
    u_hat = torch.from_numpy(decode_points(index.reshape(-1).numpy(), shells.tables)).reshape(5, DIM)
    norms = codes[:, :2].contiguous().view(torch.float16).to(torch.float32)
    torch.testing.assert_close(norms * (u_hat @ shells.forward.T), codec.decode(codes), rtol=1e-5, atol=1e-5)
    assert not isinstance(FibQuantCodec(DIM, 4, 256).reader(torch.device("cpu")), ShellsReader)


@pytest.mark.parametrize("bits", [1, 1.5, 1.75, 2])
def test_compact_tables_equal_unrank_exactly(bits):
    """Every index of the codes of <= 16 index bits: the compact tables (int8 doubled coordinates x the level's
    scale) give unrank's float64 point rounded to float32, bit for bit; their rows are E8 points (doubled:
    all even or all odd, sum = 0 mod 4) of the level's shell (squared norm 8 m), within int8."""
    levels = shipped_levels(DIM, bits)
    tables, compact = shell_tables(levels), compact_point_tables(levels)
    assert compact.count == tables.count <= COMPACT_MAX_POINTS and compact.points.shape == (tables.count, 8)
    index = np.arange(tables.count)
    got = decode_points(index, compact)
    want = unrank(index, tables).astype(np.float32)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.int32), want.view(np.int32))
    c = compact.points.astype(np.int64)
    level = np.searchsorted(tables.offsets, index, side="right") - 1
    shells = np.array(levels.shells)[level]
    assert np.array_equal((c ** 2).sum(1), 8 * shells)
    assert np.all((c % 2 == c[:, :1] % 2).all(1)) and np.all(c.sum(1) % 4 == 0)
    for g in range(len(levels.shells)):  # each level's points distinct (one level may repeat another's shell)
        rows = c[level == g]
        assert len(np.unique(rows, axis=0)) == len(rows) == shell_size(levels.shells[g])
    # the step's words: each index's two halves and level; the indices past the points flagged
    words = compact.words.astype(np.int64)
    assert len(words) == 1 << int(8 * bits) and np.all(words[tables.count:] >> 31 == 1)
    w = words[:tables.count]
    assert np.all(w >> 31 == 0) and np.array_equal((w >> 24) & 127, level)
    sign_lo, sign_hi = (1 - 2 * ((w >> 11) & 1))[:, None], (1 - 2 * ((w >> 23) & 1))[:, None]
    halves = np.concatenate([sign_lo * compact.halves[w & 2047], sign_hi * compact.halves[(w >> 12) & 2047]], axis=1)
    assert np.array_equal(halves, compact.points.astype(np.float32))
    assert np.array_equal(compact.scales32, compact.scales.astype(np.float32))
    with pytest.raises(ValueError, match="out of range"):
        decode_points(np.array([tables.count]), compact)
    with pytest.raises(ValueError, match="out of range"):
        decode_points(np.array([-1]), compact)


def test_compact_tables_bad_input():
    """Codes beyond 16 index bits have no compact tables; decode_points takes only the two table kinds."""
    with pytest.raises(ValueError, match="at most 65536 points"):
        compact_point_tables(shipped_levels(DIM, 3))
    with pytest.raises(ValueError, match="ShellPointTables or CompactPointTables"):
        decode_points(np.zeros(1, np.int64), shell_tables(shipped_levels(DIM, 2)))


def test_codec_gives_compact_tables_up_to_16_bits():
    """ShellsReader: the compact tables at b <= 2 (the step's halves tables), the decomposed ones above."""
    for bits in (1, 1.5, 1.75, 2):
        assert isinstance(E8ShellCodec(DIM, bits).reader(torch.device("cpu")).tables, CompactPointTables)
    for bits in (3, 4):
        assert isinstance(E8ShellCodec(DIM, bits).reader(torch.device("cpu")).tables, ShellPointTables)


@pytest.mark.parametrize("bits,groups,dim", [(2, 3, 64), (1.75, 6, 64), (1, 1, 128), (1.5, 4, 64)])
def test_vector_halves_rows_equal_scalar_rows(bits, groups, dim):
    """The step's row loops through the <4 x float> intrinsics (`intrinsics._build_halves`) against the scalar
    numba loops they replaced (same tables, words and weights), bad indices included (2 bits: index 65 535)."""
    numba_shells.compile_shell_kernel()
    tables = compact_point_tables(shipped_levels(dim, bits))
    ibits = int(round(8 * bits))
    rng = np.random.default_rng(7)
    n_tokens = 37
    index = rng.integers(0, tables.count, size=(n_tokens, dim // 8))
    if bits == 2:
        index[[3, 20], [1, 5]] = (1 << 16) - 1
    rows = np.zeros((n_tokens, 2 + dim * ibits // 64), np.uint8)
    for i in range(n_tokens):
        stream = sum(int(x) << (ibits * j) for j, x in enumerate(index[i]))
        rows[i, 2:] = np.frombuffer(stream.to_bytes(rows.shape[1] - 2, "little"), np.uint8)
    rq = rng.standard_normal((groups, dim)).astype(np.float32)
    norms = rng.uniform(0.5, 2.0, n_tokens).astype(np.float32)
    weights = rng.uniform(0.0, 1.0, (groups, n_tokens)).astype(np.float32)
    results = []
    for scores, values, (words, scales) in (
            (numba_shells._code_scores_compact, numba_shells._code_values_compact, (tables.words, tables.scales32)),
            (numba_shells._code_scores_halves, numba_shells._code_values_halves, numba_shells.step_words(tables))):
        args = (words, tables.halves, scales)
        table = np.empty((dim // 4, tables.halves.shape[0], 4), np.float32)
        wr = np.empty(dim // 8, np.int64)
        coded = np.zeros((groups, n_tokens), np.float32)
        acc = np.zeros((groups, dim), np.float32)
        bad_k = scores(rows, rq, groups, norms, coded, ibits, *args, table, wr)
        bad_v = values(rows, weights, groups, norms, acc, ibits, *args, table, wr)
        results.append((coded, acc, bad_k, bad_v))
    (coded0, acc0, bk0, bv0), (coded1, acc1, bk1, bv1) = results
    assert bk0 == bk1 == bv0 == bv1 == (2 if bits == 2 else 0)
    np.testing.assert_allclose(coded1, coded0, rtol=1e-5, atol=1e-5 * np.abs(coded0).max())
    np.testing.assert_allclose(acc1, acc0, rtol=1e-5, atol=1e-5 * np.abs(acc0).max())
