"""The paged numba decode step (`fibquant.kv.attention.paged`) against its reference: codes read in
place through block tables, per-sequence coded ranges, exact window + new token, sink logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fibquant.codecs.e8shell import E8ShellCodec
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.fibrvq import FibRVQCodec
from fibquant.codecs.integer import IntCodec
from fibquant.codecs.turboquant import TurboQuantCodec
from fibquant.kv.attention import paged
from fibquant.kv.attention.numba_paged import ExactParts, PagedCodes
from fibquant.kv.attention.paged import paged_decode_attention, paged_decode_attention_reference
from fibquant.kv.options import AttentionOptions

pytest.importorskip("numba")

DIM = 64
PAIRS = {
    "fibquant 4/4 bit (8-bit indices)": lambda: (FibQuantCodec(DIM, 2, 256), FibQuantCodec(DIM, 2, 256)),
    "fibquant 4/2 bit": lambda: (FibQuantCodec(DIM, 2, 256), FibQuantCodec(DIM, 4, 256)),
    "fibquant 12/10-bit indices": lambda: (FibQuantCodec(DIM, 4, 4096), FibQuantCodec(DIM, 4, 1024)),
    "fibquant 4-bit d=128": lambda: (FibQuantCodec(2 * DIM, 2, 256), FibQuantCodec(2 * DIM, 2, 256)),
    "turboquant 4/2 (byte tables)": lambda: (TurboQuantCodec(DIM, 4), TurboQuantCodec(DIM, 2)),
    "turboquant 3 (3-bit fields)": lambda: (TurboQuantCodec(DIM, 3), TurboQuantCodec(DIM, 3)),
    "fibquant 4-bit k=1 (nibbles, in registers)": lambda: (FibQuantCodec(DIM, 1, 16), FibQuantCodec(DIM, 1, 16)),
    "fibquant 4-bit k=1 d=128": lambda: (FibQuantCodec(2 * DIM, 1, 16), FibQuantCodec(2 * DIM, 1, 16)),
    "fibquant k=1 keys / 4-bit values": lambda: (FibQuantCodec(DIM, 1, 16), FibQuantCodec(DIM, 2, 256)),
}


def _scenario(pair, heads=6, kv_heads=2, block=8, token_major=True, exact=5, seed=0):
    """Three sequences scattered over 24 pages; coded ranges of different lengths (one empty)."""
    key_codec, value_codec = PAIRS[pair]()
    DIM = key_codec.dim
    generator = torch.Generator().manual_seed(seed)
    slot = key_codec.code_size + value_codec.code_size + 1  # an odd pad byte: offsets are not aligned
    if token_major:  # vLLM's LBNHC pages: the logical [blocks, Hkv, bs, slot] view of [blocks, bs, Hkv, slot]
        pages = torch.zeros(24, block, kv_heads, slot, dtype=torch.uint8).transpose(1, 2)
    else:
        pages = torch.zeros(24, kv_heads, block, slot, dtype=torch.uint8)
    tables = torch.tensor([[7, 2, 9, 4, 11, 0, 13], [5, 1, 3, 6, 8, 10, 23], [12, 14, 99, 99, 99, 99, 99]],
                          dtype=torch.int32)
    lengths = [43, 50, 9]
    for b, length in enumerate(lengths):
        keys = torch.randn(length, kv_heads, DIM, generator=generator)
        values = torch.randn(length, kv_heads, DIM, generator=generator)
        codes = torch.cat([key_codec.encode(keys), value_codec.encode(values)], dim=-1)
        for p in range(length):
            pages[tables[b, p // block], :, p % block, : codes.shape[-1]] = codes[p]
    starts, stops = [4, 0, 4], [43 - 3, 50, 4]  # sequence 2 has nothing coded
    batch = len(lengths)
    tensors = dict(
        query=torch.randn(batch, heads, DIM, generator=generator),
        exact_keys=torch.randn(batch, kv_heads, exact, DIM, generator=generator),
        exact_values=torch.randn(batch, kv_heads, exact, DIM, generator=generator),
        new_keys=torch.randn(batch, kv_heads, 1, DIM, generator=generator),
        new_values=torch.randn(batch, kv_heads, 1, DIM, generator=generator))
    return dict(pages=pages, tables=tables, starts=starts, stops=stops, key_codec=key_codec, value_codec=value_codec,
                scaling=DIM ** -0.5, **tensors)


@pytest.mark.parametrize("pair, token_major", [(pair, True) for pair in PAIRS] + [
    ("fibquant 4/2 bit", False), ("turboquant 3 (3-bit fields)", False)])
def test_paged_decode_equals_reference(pair, token_major):
    case = _scenario(pair, token_major=token_major)
    want = paged_decode_attention_reference(**case)
    got = paged_decode_attention(**case)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.fixture(params=[True, "keys", "values", False], ids=["gather", "gather-keys", "gather-values", "tables"])
def gather(request):
    """Options for every decode path of the kernel's 4-bit roles: decode-then-dot (gathers) for both, keys
    or values only, and lookup tables / histograms."""
    return AttentionOptions(gather_decode=request.param)


@pytest.mark.parametrize("pair", ["fibquant 4/4 bit (8-bit indices)", "fibquant 4/2 bit", "fibquant 4-bit d=128",
                                  "fibquant 12/10-bit indices"])
@pytest.mark.parametrize("heads", [2, 4, 6, 8, 16])
def test_paged_decode_gather_and_table_paths_equal_reference(pair, heads, gather):
    """Every group size G = Hq / Hkv (1-4 take the gathers at 4 bits, 8 keeps the tables), ragged
    coded ranges over scattered pages, sink logits: both paths equal the reference to float rounding."""
    case = _scenario(pair, heads=heads, seed=6)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(paged_decode_attention(**case, sinks=sinks, options=gather),
                               paged_decode_attention_reference(**case, sinks=sinks), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pair", ["fibquant 4-bit k=1 (nibbles, in registers)", "fibquant 4-bit k=1 d=128",
                                  "fibquant k=1 keys / 4-bit values", "turboquant 4/2 (byte tables)"])
@pytest.mark.parametrize("heads", [2, 4, 6, 8, 16])
@pytest.mark.parametrize("block", [8, 32])
def test_paged_decode_in_register_path_equals_reference(pair, heads, block, gather):
    """4-bit codes of 16 scalar codewords (k = 1: `intrinsics._build_permutes`) for G = 1..4 (8: the
    tables), pages of 8 tokens (per-token sums only) and 32 (16-token reduction trees and tails), sink logits: equal to the reference to float rounding (rtol 1e-4, atol 1e-5: the kernel
    sums the dot products in another order than torch)."""
    case = _scenario(pair, heads=heads, block=block, seed=9)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(10))
    torch.testing.assert_close(paged_decode_attention(**case, sinks=sinks, options=gather),
                               paged_decode_attention_reference(**case, sinks=sinks), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pair, setting, gathered", [
    ("fibquant 4-bit k=1 (nibbles, in registers)", True, True),
    ("fibquant 4-bit k=1 (nibbles, in registers)", "keys", True),
    ("fibquant 4-bit k=1 (nibbles, in registers)", "values", True),
    ("fibquant 4-bit k=1 d=128", True, True),
    ("fibquant 4/4 bit (8-bit indices)", True, True), ("fibquant 4/4 bit (8-bit indices)", "keys", True),
    ("fibquant 4/4 bit (8-bit indices)", "values", True), ("fibquant 4-bit d=128", True, True),
    ("fibquant 4/2 bit", "keys", True), ("fibquant 4/2 bit", "values", False),
    ("turboquant 4/2 (byte tables)", "values", False), ("turboquant 3 (3-bit fields)", True, False),
    ("turboquant 4/2 (byte tables)", True, True)])  # TurboQuant at 4 bits: the same k = 1, N = 16 codes
def test_paged_decode_gather_switch_reaches_the_kernel(pair, setting, gathered):
    """`AttentionOptions.gather_decode` changes how the 4-bit FibQuant roles it names are summed (outputs differ in
    float rounding, within 1e-5 of each other) and nothing else (other codes: bitwise the same)."""
    case = _scenario(pair, seed=8)
    on = paged_decode_attention(**case, options=AttentionOptions(gather_decode=setting))
    off = paged_decode_attention(**case, options=AttentionOptions(gather_decode=False))
    assert torch.equal(on, off) is not gathered
    torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, exact", [(2, 0), (16, 3)])
def test_paged_decode_with_sink_logits_and_other_group_sizes(heads, exact):
    case = _scenario("fibquant 4/2 bit", heads=heads, exact=exact, seed=1)
    sinks = torch.randn(heads)
    torch.testing.assert_close(paged_decode_attention(**case, sinks=sinks),
                               paged_decode_attention_reference(**case, sinks=sinks), rtol=1e-4, atol=1e-5)


def test_paged_decode_refuses_bad_input():
    case = _scenario("fibquant 4/4 bit (8-bit indices)")
    with pytest.raises(ValueError, match="coded range"):
        paged_decode_attention(**{**case, "stops": [43, 50, 57]})  # past the 7 blocks of a table row
    with pytest.raises(ValueError, match="starts and stops"):
        paged_decode_attention(**{**case, "starts": [0, 0]})
    with pytest.raises(ValueError, match="exact_keys"):
        paged_decode_attention(**{**case, "exact_keys": case["exact_keys"][:, :1]})
    bad_tables = case["tables"].clone()
    bad_tables[0, 1] = 500  # a block id outside the pages: counted and refused, never read
    with pytest.raises(ValueError, match="block id"):
        paged_decode_attention(**{**case, "tables": bad_tables})


def _as(case: dict, dtype: torch.dtype, names=("query", "exact_keys", "exact_values", "new_keys", "new_values")):
    return {**case, **{name: case[name].to(dtype) for name in names}}


@pytest.mark.parametrize("pair", ["fibquant 4/4 bit (8-bit indices)", "fibquant 4/2 bit", "turboquant 3 (3-bit fields)"])
def test_paged_decode_reads_bf16_inputs_in_place(pair):
    """bf16 query / window / new token read as their bits by the kernel (no float32 copies): the same
    result as the reference on the same bf16 values; a mix of dtypes takes the float32 path."""
    case = _as(_scenario(pair, seed=2), torch.bfloat16)
    want = paged_decode_attention_reference(**case)
    torch.testing.assert_close(paged_decode_attention(**case), want, rtol=1e-4, atol=1e-5)
    mixed = _as(case, torch.float32, names=("exact_values",))
    torch.testing.assert_close(paged_decode_attention(**mixed), want, rtol=1e-4, atol=1e-5)


def test_paged_decode_takes_strided_views_and_writes_bf16_out():
    """Query and new tokens as strided views of one fused qkv row (as vLLM hands them over), and the
    output written in place into a strided bf16 view: equal to the float32 result rounded by torch."""
    case = _as(_scenario("fibquant 4/2 bit", seed=3), torch.bfloat16)
    batch, heads, dim = case["query"].shape
    kv_heads = case["new_keys"].shape[1]
    fused = torch.cat([case["query"].reshape(batch, -1), case["new_keys"].reshape(batch, -1),
                       case["new_values"].reshape(batch, -1)], dim=1)  # [B, (Hq + 2 Hkv) * D]
    query, keys, values = fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    views = dict(query=query.view(batch, heads, dim), new_keys=keys.view(batch, kv_heads, 1, dim),
                 new_values=values.view(batch, kv_heads, 1, dim))
    assert not views["query"].is_contiguous() and not views["new_keys"].is_contiguous()
    want = paged_decode_attention(**case)  # float32 out
    torch.testing.assert_close(paged_decode_attention(**{**case, **views}), want, rtol=0, atol=0)
    flat = torch.full((batch + 2, heads * dim + 8), 7.0, dtype=torch.bfloat16)
    target = flat[1:batch + 1, :heads * dim].view(batch, heads, dim)
    got = paged_decode_attention(**{**case, **views}, out=target)
    assert got is target
    assert torch.equal(target.view(torch.int16), want.to(torch.bfloat16).view(torch.int16))
    assert (flat[0] == 7).all() and (flat[-1] == 7).all() and (flat[:, heads * dim:] == 7).all()
    with pytest.raises(ValueError, match="out must be"):
        paged_decode_attention(**case, out=torch.empty(batch, heads, dim, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_reads_exact_window_rows_in_place(dtype):
    """exact_rows: the exact window read from rows of a larger slab (the backend's window store, a
    strided view of its first n columns) instead of a gathered copy: the same result as the gathered
    call, bit for bit, and as the reference given the same rows."""
    case = _as(_scenario("fibquant 4/2 bit", seed=4), dtype)
    batch, kv_heads, exact, dim = case["exact_keys"].shape
    generator = torch.Generator().manual_seed(5)
    rows = [4, 0, 2]
    slabs = {}
    for name in ("exact_keys", "exact_values"):
        slab = torch.randn(6, kv_heads, exact + 3, dim, generator=generator).to(dtype)
        slab[rows, :, :exact] = case[name]
        slabs[name] = slab[:, :, :exact]  # a view: rows of the store, the first n columns
    in_place = {**case, **slabs, "exact_rows": rows}
    gathered = paged_decode_attention(**case)
    assert torch.equal(paged_decode_attention(**in_place), gathered)
    torch.testing.assert_close(paged_decode_attention(**in_place), paged_decode_attention_reference(**in_place),
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="exact_rows"):
        paged_decode_attention(**{**in_place, "exact_rows": [4, 0, 6]})
    with pytest.raises(ValueError, match="exact_rows"):
        paged_decode_attention(**{**in_place, "exact_rows": [4, 0]})


def test_exact_parts_reach_the_kernel_as_c_arrays():
    """The kernel reads the exact / new parts as C arrays (`paged._c_part`): a C array as it is, the first
    n columns of a C slab as that slab (a view, read to column n), anything else as a C copy."""
    slab = np.arange(2 * 3 * 7 * 4, dtype=np.float32).reshape(2, 3, 7, 4)
    got, count = paged._c_part(slab)
    assert got is slab and count == 7
    got, count = paged._c_part(slab[:, :, :5])
    assert count == 5 and got.flags.c_contiguous and np.shares_memory(got, slab) and np.array_equal(got, slab)
    heads = slab[:, 1:]  # a head slice: its rows are not one C slab
    got, count = paged._c_part(heads)
    assert count == 7 and got.flags.c_contiguous and not np.shares_memory(got, slab) and np.array_equal(got, heads)
    swapped = slab.transpose(0, 2, 1, 3)
    got, count = paged._c_part(swapped)
    assert count == 3 and got.flags.c_contiguous and np.array_equal(got, swapped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_run_paged_kernel_reads_whole_slabs_to_exact_count(dtype):
    """`run_paged_kernel` with `ExactParts(count=n)` on whole window slabs (what the vLLM backend's lean
    decode step passes) equals the call on their first n columns, bit for bit; with `record_slots` it
    also writes each new token into its row at the given column, after reading it (same result); counts
    / columns past the slab are refused by the kernel, before it writes anything."""
    case = _as(_scenario("fibquant 4/2 bit", seed=6), dtype)
    batch, kv_heads, exact, dim = case["exact_keys"].shape
    generator = torch.Generator().manual_seed(7)
    rows = [1, 3, 0]
    slabs = {}
    for name in ("exact_keys", "exact_values"):
        slab = torch.randn(4, kv_heads, exact + 2, dim, generator=generator).to(dtype)
        slab[rows, :, :exact] = case[name]
        slabs[name] = slab
    want = paged_decode_attention(**{**case, "exact_keys": slabs["exact_keys"][:, :, :exact],
                                     "exact_values": slabs["exact_values"][:, :, :exact], "exact_rows": rows})
    bits = dtype == torch.bfloat16
    host = (lambda t: t.view(torch.uint16).numpy()) if bits else (lambda t: t.numpy())
    plans = paged.paged_plans(case["key_codec"], case["value_codec"], case["query"].shape[1], kv_heads)
    keys, values = paged.paged_roles(plans)
    starts, stops = (np.array(case[n], dtype=np.int64) for n in ("starts", "stops"))
    codes = PagedCodes(case["pages"].numpy(), case["tables"].numpy(), starts, stops)
    out = torch.empty(batch, case["query"].shape[1], dim, dtype=torch.float32)

    def run(count, record=None):
        record = np.full(batch, -1, dtype=np.int64) if record is None else record
        parts = ExactParts(host(slabs["exact_keys"]), host(slabs["exact_values"]), np.array(rows, dtype=np.int64),
                           count, host(case["new_keys"].contiguous()), host(case["new_values"].contiguous()), record)
        return paged.run_paged_kernel(paged.paged_kernel(bits, False), plans, host(case["query"]), out.numpy(), keys,
                                      values, codes, parts, paged.paged_epilogue(case["scaling"]),
                                      int(max(stops - starts)))

    assert run(exact) == 0
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="exact_count"):
        run(exact + 3)
    # record_slots: each new token written into its exact row after the kernel read it (the window record)
    before = {name: slab.clone() for name, slab in slabs.items()}
    with pytest.raises(ValueError, match="record_slots"):
        run(exact, np.array([0, exact + 2, 0], dtype=np.int64))  # past the slab's columns
    assert all(torch.equal(slabs[name], before[name]) for name in slabs)  # refused before any write
    columns = np.array([exact - 1, exact + 1, 0], dtype=np.int64)  # a read column, an unread one, a read one
    out.zero_()
    assert run(exact, columns) == 0
    assert torch.equal(out, want)  # the same result: the writes come after the reads
    for name, new in (("exact_keys", "new_keys"), ("exact_values", "new_values")):
        expected = before[name].clone()
        for b, (row, column) in enumerate(zip(rows, columns)):
            expected[row, :, column] = case[new][b, :, 0]
        assert torch.equal(slabs[name], expected)


def test_run_paged_kernel_refuses_what_its_reads_rely_on():
    """The kernel checks (numba_paged._check_call) what memory safety needs, so its fast callers need no
    per-call check in Python: a longest range beyond the scratch, a coded range past a table row, an
    exact row outside the window."""
    case = _scenario("fibquant 4/2 bit", seed=6)
    batch, kv_heads = case["query"].shape[0], case["exact_keys"].shape[1]
    plans = paged.paged_plans(case["key_codec"], case["value_codec"], case["query"].shape[1], kv_heads)
    keys, values = paged.paged_roles(plans)
    stops = np.array(case["stops"], dtype=np.int64)
    out = np.empty((batch, case["query"].shape[1], DIM), dtype=np.float32)

    def run(starts, rows, longest):
        codes = PagedCodes(case["pages"].numpy(), case["tables"].numpy(), np.array(starts, dtype=np.int64), stops)
        parts = ExactParts(case["exact_keys"].numpy(), case["exact_values"].numpy(), np.array(rows, dtype=np.int64),
                           case["exact_keys"].shape[2], case["new_keys"].numpy(), case["new_values"].numpy(),
                           np.full(batch, -1, dtype=np.int64))
        return paged.run_paged_kernel(paged.paged_kernel(False, False), plans, case["query"].numpy(), out, keys,
                                      values, codes, parts, paged.paged_epilogue(case["scaling"]), longest)

    assert run(case["starts"], [0, 1, 2], 50) == 0
    with pytest.raises(ValueError, match="coded range"):
        run([-1, 0, 4], [0, 1, 2], 51)
    with pytest.raises(ValueError, match="exact_rows"):
        run(case["starts"], [0, 3, 2], 50)


def test_kernel_signature_matches_its_structures():
    """The compiled signature lays out each structure's fields in their order (`numba_paged._signature`)."""
    from numba.core import sigutils

    from fibquant.kv.attention import numba_decode, numba_paged

    args, _ = sigutils.normalize_signature(numba_paged._signature("float32", "uint16"))
    structures = (numba_paged.PagedRole, numba_paged.PagedRole, PagedCodes, ExactParts, numba_paged.PagedEpilogue,
                  numba_decode.StepScratch)
    assert len(args) == 2 + len(structures) + 2
    for arg, structure in zip(args[2:], structures):
        assert len(arg) == len(structure._fields), structure.__name__


@pytest.mark.parametrize("pair", ["fibquant 4/4 bit (8-bit indices)", "fibquant 4/2 bit",
                                  "fibquant 4-bit k=1 (nibbles, in registers)", "turboquant 3 (3-bit fields)"])
@pytest.mark.parametrize("heads", [2, 6, 16])
def test_paged_decode_softcap_with_sinks_and_windows_equals_reference(pair, heads, gather):
    """Logit soft-capping (Gemma 2) in the kernel, through the shared epilogue, combined with sink logits
    and windowed coded ranges (sequences attending to [start, stop) of their pages, one with none, beside
    their exact window): equal to the reference (`reference.epilogue_weights`) to float rounding; a cap
    small enough to bend the scores changes the result."""
    case = _scenario(pair, heads=heads, seed=11)
    case["starts"], case["stops"] = [12, 3, 4], [43 - 3, 30, 4]  # windows over the pages
    case["query"] = case["query"] * 4  # scores large enough for the cap to bend them
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(12))
    capped = paged_decode_attention(**case, softcap=2.0, sinks=sinks, options=gather)
    torch.testing.assert_close(capped, paged_decode_attention_reference(**case, softcap=2.0, sinks=sinks),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(paged_decode_attention(**case, softcap=2.0, options=gather),
                               paged_decode_attention_reference(**case, softcap=2.0), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(capped, paged_decode_attention(**case, sinks=sinks, options=gather), atol=1e-3)


def test_paged_decode_refuses_a_bad_softcap_or_sinks():
    case = _scenario("fibquant 4/2 bit")
    for softcap in (0.0, -1.0):
        with pytest.raises(ValueError, match="softcap"):
            paged_decode_attention(**case, softcap=softcap)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention(**case, sinks=torch.zeros(5))


READER_PAIRS = {  # codes the paged numba kernel does not read: served through their codecs' readers
    "e8shell 2/4 bit": lambda: (E8ShellCodec(DIM, 2), E8ShellCodec(DIM, 4)),
    "fibrvq keys / fibquant values": lambda: (FibRVQCodec(DIM, stages=2), FibQuantCodec(DIM, 4, 256)),
    "int4 (decoded)": lambda: (IntCodec(DIM, 4), IntCodec(DIM, 4)),
}


@pytest.mark.filterwarnings("ignore:IntCodec has no reader of its own")
@pytest.mark.parametrize("pair", sorted(READER_PAIRS))
def test_every_code_family_through_the_paged_step(monkeypatch, pair):
    """E8 shells, residual stages and a codec with no reader of its own go through `paged_readers` (each
    sequence's codes gathered and read by its readers), with sinks, soft-capped or not: equal to the spec."""
    monkeypatch.setitem(PAIRS, pair, READER_PAIRS[pair])
    case = _scenario(pair)
    assert paged.paged_plans(case["key_codec"], case["value_codec"], 6, 2) is None
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(5))
    for softcap in (None, 2.0):
        want = paged_decode_attention_reference(**case, sinks=sinks, softcap=softcap)
        torch.testing.assert_close(paged_decode_attention(**case, sinks=sinks, softcap=softcap), want, rtol=1e-4,
                                   atol=1e-5)
