"""Measurement helpers and the baselines the fractal archive is compared with.

    raw-numpy      smallest uint dtype, .npy, memory-mapped
    bitpack        ceil(log2 N) bits per symbol, numpy bit packing
    zstd-3 / -19   raw bytes in independent frames (seekable), one frame decompressed per lookup
    sorted-keys    argsort of the l-gram keys of the raw array (search only)
    suffix-array   pydivsufsort suffix array (search only)

Timing: vectorised jobs are the best of a few repeats of the whole job; per-call costs
(lookups, queries) are the fastest batch of calls over all calls (`time_lookups`).

Checks: every method's lookups are compared with the stream (`check_lookups`: a store that
gives back other symbols raises `BenchmarkCheckError`, its timings would mean nothing), and
every search method's recall and precision are measured against brute force
(`search_quality`), so a missed or spurious hit shows in the results.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right

import numpy as np

from fibquant._extras import require
from fibquant.archive import brute_force_search
from fibquant.archive.search import key_depth
from fibquant.eval.timing import Stopwatch, best_of, timed


class BenchmarkCheckError(RuntimeError):
    """A benchmarked store gave back other symbols than it was given."""


def check_lookups(method: str, get, symbols: np.ndarray, positions: list[int]) -> None:
    """Raise BenchmarkCheckError unless get(i) == symbols[i] at every position."""
    wrong = [i for i in positions if get(i) != symbols[i]]
    if wrong:
        raise BenchmarkCheckError(f"{method}: {len(wrong)} of {len(positions)} lookups returned wrong symbols "
                                  f"(first at position {wrong[0]}: {get(wrong[0])} != {symbols[wrong[0]]})")


def search_quality(search, symbols: np.ndarray, queries) -> tuple[float, float]:
    """(recall, precision) of `search(query) -> end positions` against brute force, pooled
    over the queries (nan when no query has a true match / nothing was returned)."""
    found = true = returned = 0
    for query in queries:
        truth = brute_force_search(symbols, query)
        got = np.unique(np.asarray(search(query), dtype=np.int64))
        found += np.intersect1d(truth, got).size
        true += truth.size
        returned += got.size
    return (found / true if true else math.nan), (found / returned if returned else math.nan)


def best_time(fn, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of `fn()` (`timing.best_of` without the result)."""
    return best_of(fn, repeats)[0]


def time_lookups(get, items: list, repeats: int, batch: int = 1000) -> float:
    """µs per call of get(item): the best batch of `batch` calls over `repeats` passes.

    On a shared machine a long loop is preempted many times; the fastest batch of ~1000
    calls is the cost of the code itself (timeit's rule), and every call is still made."""
    best = math.inf
    for _ in range(repeats):
        for start in range(0, len(items), batch):
            chunk = items[start:start + batch]

            def calls(chunk=chunk):
                for item in chunk:
                    get(item)
            best = min(best, timed(calls)[0] / len(chunk))
    return best * 1e6


def sample_queries(symbols: np.ndarray, count: int, length: int, rng, limit: int) -> np.ndarray:
    ends = rng.integers(length - 1, limit, count)
    return np.stack([symbols[e - length + 1:e + 1] for e in ends])


def smallest_dtype(alphabet: int):
    return np.uint8 if alphabet <= 256 else np.uint16 if alphabet <= 65536 else np.uint32


def bench_raw(stream, config, workdir, rng) -> dict:
    alphabet, symbols = stream["alphabet"], stream["symbols"]
    n, dtype = symbols.shape[0], smallest_dtype(alphabet)
    path = workdir / "raw.npy"
    row = {"method": "raw-numpy"}
    row["encode_us"] = best_time(lambda: symbols.astype(dtype), config.repeats) / n * 1e6
    row["pack_us"] = best_time(lambda: np.save(path, symbols.astype(dtype)), config.repeats) / n * 1e6
    row["bits_per_symbol"] = 8 * path.stat().st_size / n
    mapped = np.load(path, mmap_mode="r")
    positions = rng.integers(0, n, config.lookups).tolist()
    row["random_access_us"] = time_lookups(lambda i: int(mapped[i]), positions, config.repeats)
    appended = symbols[:config.appends].tolist()

    def append_single():  # the archive's buffering without its encoding and checksums
        pending = []
        with open(workdir / "raw-append.bin", "wb") as handle:
            for s in appended:
                pending.append(s)
                if len(pending) >= 8192:
                    handle.write(np.array(pending, dtype=dtype).tobytes())
                    pending.clear()
            handle.write(np.array(pending, dtype=dtype).tobytes())
    row["append_us"] = best_time(append_single, config.repeats) / len(appended) * 1e6
    return row


def bench_bitpack(stream, config, workdir, rng) -> dict:
    alphabet, symbols = stream["alphabet"], stream["symbols"]
    n, bits = symbols.shape[0], max(1, math.ceil(math.log2(alphabet)))

    def encode():
        bit_matrix = ((symbols[:, None] >> np.arange(bits)) & 1).astype(np.uint8)
        return np.packbits(bit_matrix.reshape(-1), bitorder="little").tobytes()
    row = {"method": "bitpack"}
    row["encode_us"] = best_time(encode, config.repeats) / n * 1e6
    packed = encode()
    path = workdir / "bitpack.bin"
    path.write_bytes(packed)
    row["bits_per_symbol"] = 8 * len(packed) / n
    mask = (1 << bits) - 1

    def get(i):
        start = i * bits
        chunk = packed[start >> 3:(start + bits + 7 >> 3) + 1]
        return (int.from_bytes(chunk, "little") >> (start & 7)) & mask
    positions = rng.integers(0, n, config.lookups).tolist()
    check_lookups("bitpack", get, symbols, positions[:1000])
    row["random_access_us"] = time_lookups(get, positions, config.repeats)
    return row


def bench_zstd(level: int, stream, config, workdir, rng) -> dict:
    zstandard = require("zstandard", "the zstd baseline")

    alphabet, symbols = stream["alphabet"], stream["symbols"]
    n, dtype = symbols.shape[0], smallest_dtype(alphabet)
    raw = symbols.astype(dtype)
    frame = config.zstd_frame
    compressor = zstandard.ZstdCompressor(level=level)

    def encode():
        return [compressor.compress(raw[s:s + frame].tobytes()) for s in range(0, n, frame)]
    row = {"method": f"zstd-{level}"}
    row["encode_us"] = best_time(encode, 1 if level > 10 else config.repeats) / n * 1e6
    frames = encode()
    offsets = np.cumsum([0] + [len(f) for f in frames]).tolist()
    blob = b"".join(frames)
    row["bits_per_symbol"] = 8 * (len(blob) + 8 * len(frames)) / n  # frames + an offset table
    decompressor = zstandard.ZstdDecompressor()

    def get(i):
        k = i // frame
        data = decompressor.decompress(blob[offsets[k]:offsets[k + 1]])
        return int(np.frombuffer(data, dtype=dtype)[i - k * frame])
    positions = rng.integers(0, n, config.zstd_lookups).tolist()
    check_lookups(row["method"], get, symbols, positions[:50])
    row["random_access_us"] = time_lookups(get, positions, 1, batch=50)
    return row


def bench_search_baselines(stream, config, rng) -> list[dict]:
    pydivsufsort = require("pydivsufsort", "the suffix-array baseline")

    alphabet = stream["alphabet"]
    rows = {"sorted-keys": {"method": "sorted-keys"}, "suffix-array": {"method": "suffix-array"}}
    for size in config.search_sizes:
        tag = f"1e{round(math.log10(size))}"
        symbols = stream["symbols"][:size]
        l = config.query_length
        queries = sample_queries(symbols, config.queries, l, rng, size)
        # sorted l-gram keys: the first m <= D symbols of every l-gram packed into a uint64,
        # argsorted; the other l - m symbols are verified against the raw array.
        m = min(l, key_depth(alphabet))
        with Stopwatch() as build:
            keys = np.zeros(size - l + 1, dtype=np.uint64)
            for j in range(m):
                keys = keys * np.uint64(alphabet) + symbols[j:size - l + 1 + j].astype(np.uint64)
            order = np.argsort(keys, kind="stable")
            sorted_keys = keys[order]
        rows["sorted-keys"][f"index_build_s_{tag}"] = build.seconds

        def gram_search(q):
            key = 0
            for c in q[:m].tolist():
                key = key * alphabet + c
            key = np.uint64(key)
            hits = order[sorted_keys.searchsorted(key, "left"):sorted_keys.searchsorted(key, "right")]
            for j in range(m, l):
                hits = hits[symbols[hits + j] == q[j]]
            return np.sort(hits) + (l - 1)
        rows["sorted-keys"][f"search_us_{tag}"] = time_lookups(gram_search, list(queries), config.repeats, 100)
        # suffix array
        dtype = smallest_dtype(alphabet)
        data = symbols.astype(dtype)
        seconds, sa = timed(lambda: pydivsufsort.divsufsort(data))
        rows["suffix-array"][f"index_build_s_{tag}"] = seconds
        if dtype == np.uint8:
            def sa_find(q):
                count, first = pydivsufsort.sa_search(data, sa, q.astype(np.uint8))
                return np.sort(sa[first:first + count]).astype(np.int64) + (l - 1)
        else:
            big = data.astype(">u2").tobytes()
            sa_list = sa.tolist()

            def sa_find(q):
                pattern = q.astype(">u2").tobytes()
                width = len(pattern)
                key = lambda p: big[2 * p:2 * p + width]  # noqa: E731
                lo = bisect_left(sa_list, pattern, key=key)
                hi = bisect_right(sa_list, pattern, key=key)
                return np.sort(np.array(sa_list[lo:hi], dtype=np.int64)) + (l - 1)
        rows["suffix-array"][f"search_us_{tag}"] = time_lookups(sa_find, list(queries), config.repeats, 100)
        for name, search in (("sorted-keys", gram_search), ("suffix-array", sa_find)):
            recall, precision = search_quality(search, symbols, queries[:config.recall_queries])
            rows[name][f"recall_{tag}"], rows[name][f"precision_{tag}"] = recall, precision
    return list(rows.values())
