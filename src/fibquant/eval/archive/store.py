"""Saved-cache store targets (`fibquant eval archive-kv --parts store,search`).

store: an 8k-token cache of the model's shapes (30 layers x 3 KV heads x 64 for SmolLM2)
    holding *synthetic* keys/values (standard normal floats: a real 8k prefill costs minutes on
    this CPU, and neither the open time, the token read time nor the archive's bytes depend on
    the values: the exact variant stores every index at log2 N bits whatever it is), FibQuant
    2 bits, saved; median time to open it (fresh `PersistentCache.open`, repeats), median time
    of `token(layer, head, i)` at random (layer, head, i), cold (a fresh open: the first touch of
    each archive block verifies its CRC and payload) and warm (blocks already verified); on-disk
    code-stream bytes per coded token against the in-memory code bytes per coded token.

search: code-stream search on real KV.
    (a) in place in a saved cache (the real prefix of the TTFT part, both roles): queries are the
        codes of n consecutive tokens in one (layer, head) (n = 1, 4, 16), answered by
        `PersistentCache.find` (single) and `find_many` (batched); brute force = numpy comparison
        of every start position of that head's code rows; recall must be 1.00.
    (b) at 10^5-10^6 stored tokens: the layer-0 value codes of one KV head over the first N tokens
        of the six Austen novels (layer-0 values are v_proj(norm(embedding)): real KV that needs
        no forward pass, so 10^6 tokens cost seconds), stored in a CodeArchive; queries are the
        codes of n consecutive tokens (n = 1, 4, 32) at random positions, answered by
        `CodeArchive.find` (the row index: each code's index symbols as chunk values, i.e. the
        archive's suffix keys at the row's end, plus its norm; candidates from the rarest query
        code, compared as integers); brute force = numpy over the code rows. Single: the median
        of one-query calls; batched: `find_many` over all queries (best of repeats) / queries.
        For reference, the suffix search of the n x 16 index symbols (`Archive.search`, no
        row alignment) is timed too.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from fibquant.eval.timing import Stopwatch, median_us, timed


@torch.no_grad()
def measure_store(model, tokens: int = 8192, method: str = "fibquant:b=2", reads: int = 2000,
                  opens: int = 9, seed: int = 0, workdir=None, warm_passes: int = 3) -> dict:
    from transformers import DynamicCache

    from fibquant.codecs.registry import parse_codec_spec
    from fibquant.kv.cache import CompressedCache
    from fibquant.kv.model import check_model_supported
    from fibquant.kv.persist.store import PersistentCache

    info = check_model_supported(model)
    L, H, D = info["layers"], info["kv_heads"], info["head_dim"]
    codec = parse_codec_spec(method).build(D)
    generator = torch.Generator().manual_seed(seed)
    source = DynamicCache()
    for layer in range(L):
        source.update(torch.randn(1, H, tokens, D, generator=generator),
                      torch.randn(1, H, tokens, D, generator=generator), layer)
    with Stopwatch() as encode:
        cache = CompressedCache.from_cache(source, codec, codec, 4, 32)
    encode_s = encode.seconds
    del source
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=generator)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(workdir or tmp) / "store8k.fqkv"
        save_s, _ = timed(lambda: cache.save(path, model, ids, overwrite=True))
        open_times = []
        for _ in range(opens):
            seconds, store = timed(lambda: PersistentCache.open(path))
            open_times.append(seconds)
            store.close()
        rng = np.random.default_rng(seed)
        picks = [(int(rng.integers(L)), int(rng.integers(H)), int(rng.integers(4, tokens - 32))) for _ in range(reads)]
        passes = []  # the read times of each pass: the first cold (fresh open), then warm
        mismatches = 0
        with PersistentCache.open(path) as store:
            for _ in range(1 + warm_passes):
                times, pairs = [], []
                for layer, head, i in picks:
                    seconds, pair = timed(lambda: store.token(layer, head, i))
                    times.append(seconds)
                    pairs.append(pair)
                passes.append(times)
                for (layer, head, i), (k, v) in zip(picks, pairs):  # every read against the codec's decode
                    ref = cache.layers[layer]
                    mismatches += not torch.equal(k, codec.decode(ref.key_codes[0, head, i - 4:i - 3])[0])
                    mismatches += not torch.equal(v, codec.decode(ref.value_codes[0, head, i - 4:i - 3])[0])
            disk = store.nbytes()
            coded = store.num_coded
            with_header = disk["keys"] + disk["values"]
        warm_medians = [median_us(times) for times in passes[1:]]
        results = {"cold": (median_us(passes[0]), mismatches),
                   "warm": (median_us([t for times in passes[1:] for t in times]), mismatches)}
        memory_codes = sum(layer.key_buffer.used_nbytes() + layer.value_buffer.used_nbytes() for layer in cache.layers)
        from fibquant.archive.format import HEADER_SIZE

        headers = 4 * HEADER_SIZE  # indices + norms archive of each role
        total_disk = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {
        "tokens": tokens, "codec": repr(codec), "values": "synthetic standard normal (model shapes)",
        "layers": L, "kv_heads": H, "head_dim": D, "encode_s": encode_s, "save_s": save_s,
        "open_ms_median": 1e3 * statistics.median(open_times), "open_ms_all": [1e3 * t for t in open_times],
        "token_read_us_median_cold": results["cold"][0], "token_read_us_median_warm": results["warm"][0],
        "token_read_us_warm_pass_medians": warm_medians,
        "token_reads": reads, "token_read_mismatches_vs_codec_decode": results["cold"][1],
        "coded_tokens": coded, "memory_code_bytes_per_token": memory_codes / coded,
        "disk_code_bytes_per_token": (with_header - headers) / coded,
        "disk_code_bytes_per_token_with_headers": with_header / coded,
        "disk_over_memory": (with_header - headers) / memory_codes, "archive_headers_bytes": headers,
        "disk_total_bytes": total_disk, "memory_used_nbytes": cache.used_nbytes(),
    }


def measure_find(path, lengths=(1, 4, 16), queries: int = 200, seed: int = 0, repeats: int = 5) -> dict:
    """(a): multi-token code queries in one head, in place in a saved cache, vs brute force:
    `PersistentCache.find` one query at a time (median), and `find_many` over all the queries of
    a row (best of `repeats`, divided by the number of queries)."""
    from fibquant.kv.persist.store import PersistentCache

    out = {}
    with PersistentCache.open(path) as store:
        m, coded = store.manifest, store.num_coded
        rng = np.random.default_rng(seed)
        for role, stream in (("keys", store.key_stream), ("values", store.value_stream)):
            all_rows = store._code_rows(stream, 0, coded).numpy()  # noqa: SLF001 - [coded, L, B, H, cs]
            build_s, _ = timed(lambda: store.find(all_rows[0, 0, 0, 0][None], 0, 0, role))  # builds the row index
            for n in lengths:
                picks = [(int(rng.integers(m.layers)), int(rng.integers(m.kv_heads)), int(rng.integers(coded - n + 1)))
                         for _ in range(queries)]
                batch = np.stack([all_rows[t:t + n, layer, 0, head] for layer, head, t in picks])   # [q, n, cs]
                layers, heads = [p[0] for p in picks], [p[1] for p in picks]
                times, recall, hits, exact = [], [], [], True
                many = store.find_many(batch, layers, heads, role)
                for (layer, head, t), query, got_many in zip(picks, batch, many):
                    seconds, found = timed(lambda: store.find(query, layer, head, role))
                    times.append(seconds)
                    head_rows = all_rows[:, layer, 0, head]                   # [coded, cs]
                    match = np.ones(coded - n + 1, dtype=bool)
                    for j in range(n):
                        match &= (head_rows[j:coded - n + 1 + j] == query[j]).all(axis=1)
                    truth = np.flatnonzero(match)
                    recall.append(np.isin(truth, found).mean())
                    exact &= np.array_equal(truth, found) and np.array_equal(truth, got_many)
                    hits.append(truth.size)
                batched = min(timed(lambda: store.find_many(batch, layers, heads, role))[0] for _ in range(repeats))
                out[f"{role}_n{n}"] = {"role": role, "query_tokens": n, "query_symbols": n * stream.layout.n_blocks,
                                       "search_us_median": median_us(times),
                                       "search_us_p90": 1e6 * float(np.percentile(times, 90)),
                                       "batched_us_per_query": 1e6 * batched / queries, "queries": queries,
                                       "index_build_s": build_s, "recall": float(np.mean(recall)),
                                       "identical_to_brute_force": bool(exact), "mean_hits": float(np.mean(hits))}
        out["stream_index_symbols"] = len(store.key_stream.archives[0])
        out["coded_tokens"] = coded
    return out


@torch.no_grad()
def layer0_value_codes(model, tokenizer, count: int, head: int = 0, method: str = "fibquant:b=2"):
    """(codes uint8 [count, code_size], token ids [count], codec) of layer-0 values of one KV head
    over the first `count` tokens of the Austen novels (concatenated)."""
    from fibquant.data.text import TEXTS, load_text
    from fibquant.codecs.registry import parse_codec_spec
    from fibquant.kv.model import check_model_supported

    info = check_model_supported(model)
    codec = parse_codec_spec(method).build(info["head_dim"])
    pieces, total = [], 0
    for name, source in TEXTS.items():
        if source.author != "Jane Austen" or total >= count:
            continue
        ids = tokenizer(load_text(name), add_special_tokens=False, return_tensors="pt").input_ids[0]
        pieces.append(ids)
        total += ids.shape[0]
    ids = torch.cat(pieces)
    if ids.shape[0] < count:
        raise ValueError(f"the Austen novels hold {ids.shape[0]} tokens, fewer than {count}")
    ids = ids[:count]
    layer0 = model.model.layers[0]
    embeddings = model.model.embed_tokens.weight.detach().float()
    values = layer0.self_attn.v_proj(layer0.input_layernorm(embeddings[None]))[0]   # [vocab, H*D]
    table = codec.encode(values.reshape(-1, info["kv_heads"], info["head_dim"])[:, head])  # [vocab, cs]
    return table[ids].numpy(), ids.numpy(), codec


def measure_search_scale(model, tokenizer, sizes=(100_000, 1_000_000), lengths=(1, 4, 32), queries: int = 200,
                         seed: int = 0, workdir=None, repeats: int = 5) -> list[dict]:
    """(b): one head's layer-0 value codes at 10^5-10^6 tokens in a CodeArchive, searched in place."""
    from fibquant.archive import CodeArchive, CodeLayout

    codes_all, _, codec = layer0_value_codes(model, tokenizer, max(sizes))
    layout = CodeLayout.from_codec(codec)
    nb = layout.n_blocks
    rows = []
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            codes = codes_all[:size]
            path = Path(workdir or tmp) / f"layer0_values_{size}"
            archive = CodeArchive.create(path, layout, overwrite=True)
            archive.append(codes)
            archive.close()
            archive = CodeArchive.open(path)
            build_s, _ = timed(lambda: (archive.indices.search_index(), archive.find(codes[:1])))
            q_indices, _ = layout.split(codes)
            for n in lengths:
                starts = rng.integers(0, size - n + 1, size=queries).tolist()
                batch = np.stack([codes[t:t + n] for t in starts])               # [q, n, code_size]
                times, symbol_times, found = [], [], []
                for t, query in zip(starts, batch):
                    seconds, hits = timed(lambda: archive.find(query))
                    times.append(seconds)
                    found.append(hits)
                    symbols = q_indices[t:t + n].reshape(-1)
                    symbol_times.append(timed(lambda: archive.indices.search(symbols))[0])
                batched = min(timed(lambda: archive.find_many(batch))[0] for _ in range(repeats))
                many = archive.find_many(batch)
                recall, exact, hits = [], True, []
                for t, got, got_many in zip(starts, found, many):
                    match = np.flatnonzero((codes[: size - n + 1] == codes[t]).all(axis=1))
                    for j in range(1, n):
                        match = match[(codes[match + j] == codes[t + j]).all(axis=1)]
                    recall.append(np.isin(match, got).mean())
                    exact &= np.array_equal(match, got) and np.array_equal(match, got_many)
                    hits.append(match.size)
                rows.append({"stored_tokens": size, "stored_index_symbols": size * nb, "query_tokens": n,
                             "query_symbols": n * nb, "index_build_s": build_s,
                             "search_us_median": median_us(times),
                             "search_us_p90": 1e6 * float(np.percentile(times, 90)),
                             "batched_us_per_query": 1e6 * batched / queries,
                             "symbol_search_us_median": median_us(symbol_times),
                             "recall": float(np.mean(recall)), "identical_to_brute_force": bool(exact),
                             "mean_hits": float(np.mean(hits)), "queries": queries})
            archive.close()
    return rows
