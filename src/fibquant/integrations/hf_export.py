"""Write a model (the default GGUF, any GGUF, or a transformers directory) as a Hugging Face
safetensors directory that serving engines such as vLLM load.

Why a module of its own: vLLM's GGUF support moved to a plugin whose kernels need CUDA, so on a
CPU the model has to arrive as plain safetensors. Tied input/output embeddings are the trap:
transformers saves a tied pair once, under whichever name it keeps, and vLLM's Llama loader reads
the embedding only as `model.embed_tokens.weight` (absent, the embedding stays at its random
initialisation and the engine emits token 0 forever). The export therefore checks the written
file and renames a lone `lm_head.weight` to `model.embed_tokens.weight` when the weights are tied.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

EMBEDDING_NAME = "model.embed_tokens.weight"
HEAD_NAME = "lm_head.weight"


def export_hf(out_dir: str | os.PathLike, model: str | os.PathLike | None = None,
              dtype: str = "bfloat16", overwrite: bool = False) -> Path:
    """Save `model` (None: the default SmolLM2 GGUF) with its tokenizer under `out_dir`.

    dtype: "bfloat16", "float16" or "float32" (the stored weight dtype). Refuses a non-empty
    `out_dir` unless `overwrite`. Returns the directory. Raises ValueError on bad input.
    """
    import torch

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if dtype not in dtypes:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(dtypes)}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is not empty; pass overwrite=True (--overwrite) to replace its files")
    from fibquant.kv.model import load_model

    loaded, tokenizer = load_model(model, dtype=dtypes[dtype], dense=True)
    out.mkdir(parents=True, exist_ok=True)
    loaded.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    tied = bool(getattr(loaded.config, "tie_word_embeddings", False))
    if tied:
        _name_tied_embedding(out)
    check_export(out)
    return out


def _weight_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors file in {directory}")
    return files


def _name_tied_embedding(directory: Path) -> None:
    """Store a tied embedding as `model.embed_tokens.weight` (what vLLM reads), once."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    names = set()
    for file in _weight_files(directory):
        with safe_open(file, "pt") as handle:
            names.update(handle.keys())
    if EMBEDDING_NAME in names:
        return
    if HEAD_NAME not in names:
        raise ValueError(f"tied model saved neither {EMBEDDING_NAME} nor {HEAD_NAME}; cannot export it")
    for file in _weight_files(directory):
        with safe_open(file, "pt") as handle:
            if HEAD_NAME not in handle.keys():
                continue
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
            metadata = handle.metadata()
        tensors[EMBEDDING_NAME] = tensors.pop(HEAD_NAME)
        save_file(tensors, str(file), metadata=metadata)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            table = json.loads(index.read_text())
            table["weight_map"][EMBEDDING_NAME] = table["weight_map"].pop(HEAD_NAME)
            index.write_text(json.dumps(table, indent=2))
        return


def check_export(directory: str | os.PathLike) -> dict:
    """Check an exported directory: config, tokenizer and an embedding under the name vLLM reads.

    Returns {"config": dict, "tensors": count, "embedding": name}. Raises ValueError if not servable.
    """
    from safetensors import safe_open

    directory = Path(directory)
    config_file = directory / "config.json"
    if not config_file.exists():
        raise ValueError(f"{directory} has no config.json")
    config = json.loads(config_file.read_text())
    if not (directory / "tokenizer.json").exists() and not (directory / "tokenizer_config.json").exists():
        raise ValueError(f"{directory} has no tokenizer files")
    names: set[str] = set()
    for file in _weight_files(directory):
        with safe_open(file, "pt") as handle:
            names.update(handle.keys())
    if EMBEDDING_NAME not in names:
        raise ValueError(f"{directory} stores no {EMBEDDING_NAME}: vLLM would serve a random embedding")
    return {"config": config, "tensors": len(names), "embedding": EMBEDDING_NAME}
