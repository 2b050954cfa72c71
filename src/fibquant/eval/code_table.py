"""The measured code table behind `fibquant.choose_code`: attention error per shipped code on SmolLM2.

Protocol (the attention-fidelity protocol of `fibquant.eval.fidelity`, FibQuant paper 4.2): capture the
real post-RoPE queries, keys and values of every layer of the default model on a `tokens`-long span of
one novel; replace every key by its key codec's round trip and every value by its value codec's (no
exact window: the codes alone are measured); the row's `attention_error` is 1 - the mean cosine between
the compressed and the exact attention output (every query head, every `query_stride`-th position, every
layer). `key_bytes` / `value_bytes` are the stored bytes of one vector at the measured head size.

Rows: every shipped calibration-free code of `CANDIDATES` on both roles, and "keys finer" rows (the key
one rung above the value within a family, `KEY/VALUE`). `write_table` stores them as the JSON that ships
in the package (`fibquant/kv/code_table.json`, read by `fibquant.kv.budget`); `benchmarks/code_table.py`
runs it.
"""
from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

# Calibration-free codes whose codebooks ship (no build at first use), per family from coarse to fine.
CANDIDATES: dict[str, tuple[str, ...]] = {
    "fibquant": ("fibquant:b=0.5", "fibquant:b=1", "fibquant:b=2", "fibquant:b=2.5", "fibquant:b=3",
                 "fibquant:b=3.5", "fibquant:b=4"),
    "e8shell": ("e8shell:b=1,nc=1", "e8shell:b=1.5,nc=1", "e8shell:b=1.75,nc=1", "e8shell:b=2,nc=1",
                "e8shell:b=3,nc=1", "e8shell:b=4,nc=1"),
    "fibrvq": ("fibrvq:b=2", "fibrvq:b=3", "fibrvq:b=4"),
    "turboquant": ("turboquant:b=1", "turboquant:b=2", "turboquant:b=3", "turboquant:b=4"),
    "int": ("int:b=2", "int:b=3", "int:b=4", "int:b=8"),
}


def candidate_pairs() -> list[tuple[str, str]]:
    """(key spec, value spec): each code on both roles, then each family's keys-one-rung-finer pairs."""
    pairs = [(spec, spec) for specs in CANDIDATES.values() for spec in specs]
    pairs += [(finer, coarser) for specs in CANDIDATES.values() for coarser, finer in zip(specs, specs[1:])]
    return pairs


def measure(model, tokenizer, text: str = "emma", tokens: int = 512, query_stride: int = 4,
            pairs: list[tuple[str, str]] | None = None) -> list[dict]:
    """One row per (key spec, value spec) pair: bytes per vector and attention error on `text`."""
    from fibquant.codecs.registry import parse_codec_spec
    from fibquant.eval.capture import capture_attention
    from fibquant.eval.fidelity import exact_outputs, output_cosine, reconstruct
    from fibquant.eval.kv_report import text_tokens

    captured = capture_attention(model, text_tokens(tokenizer, text, tokens, 0))
    dim = captured.keys.shape[-1]
    positions = torch.arange(0, tokens, query_stride)
    reference = exact_outputs(captured, positions)
    codecs, keys_hat, values_hat = {}, {}, {}
    rows = []
    for key_spec, value_spec in pairs or candidate_pairs():
        for spec in (key_spec, value_spec):
            if spec not in codecs:
                codec = codecs[spec] = parse_codec_spec(spec).build(dim)
                keys_hat[spec] = reconstruct(captured.keys, lambda layer, head: codec, shared=True)
                values_hat[spec] = reconstruct(captured.values, lambda layer, head: codec, shared=True)
        cosine = output_cosine(captured, keys_hat[key_spec], values_hat[value_spec], positions, reference=reference)
        rows.append({"cache": key_spec if key_spec == value_spec else f"{key_spec}/{value_spec}",
                     "key_bytes": int(codecs[key_spec].code_size), "value_bytes": int(codecs[value_spec].code_size),
                     "attention_error": round(1.0 - float(cosine.mean()), 7)})
    return rows


def write_table(path, model, tokenizer, text: str = "emma", tokens: int = 512, query_stride: int = 4) -> Path:
    """Measure every candidate and write the table JSON to `path`."""
    import transformers

    from fibquant.kv.model import describe_model

    rows = measure(model, tokenizer, text, tokens, query_stride)
    payload = {
        "what": "attention error (1 - mean cosine of compressed vs exact attention output) per code, every "
                "layer, no exact window; key_bytes / value_bytes: stored bytes of one vector at head_dim",
        "model": describe_model(model), "head_dim": int(model.config.head_dim), "text": text, "tokens": tokens,
        "query_stride": query_stride, "command": "python benchmarks/code_table.py",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "rows": rows,
    }
    path = Path(path)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path
