"""`fibquant model export-hf`: the default GGUF as a safetensors directory a serving engine loads."""
from __future__ import annotations

import json

import pytest
import torch

from fibquant.integrations.hf_export import EMBEDDING_NAME, HEAD_NAME, _name_tied_embedding, check_export, export_hf


def test_refuses_bad_dtype_and_non_empty_directory(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        export_hf(tmp_path / "a", dtype="int8")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        export_hf(tmp_path / "b")
    assert (tmp_path / "b" / "keep.txt").read_text() == "mine"  # nothing lost


def test_lone_head_weight_is_renamed_to_the_embedding_vllm_reads(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    head = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    save_file({HEAD_NAME: head, "model.norm.weight": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    _name_tied_embedding(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        assert set(handle.keys()) == {EMBEDDING_NAME, "model.norm.weight"}
        assert torch.equal(handle.get_tensor(EMBEDDING_NAME), head)


def test_check_export_refuses_a_directory_without_the_embedding(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "tokenizer.json").write_text("{}")
    save_file({HEAD_NAME: torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=EMBEDDING_NAME):
        check_export(tmp_path)


@pytest.mark.model
def test_exported_default_model_reloads_with_the_same_predictions(tmp_path):
    from transformers import AutoModelForCausalLM

    from fibquant.kv.model import load_model

    out = export_hf(tmp_path / "hf", dtype="float32")
    info = check_export(out)
    assert "quantization_config" not in info["config"]  # dense weights, not GGUF blocks
    reference, tokenizer = load_model()
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = tokenizer("The capital of France is Paris. The capital of Italy is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want, got = reference(ids).logits, exported(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_cli_export_refuses_a_non_empty_directory_with_a_clear_error(tmp_path, capsys):
    from fibquant.cli import main

    (tmp_path / "keep.txt").write_text("mine")
    assert main(["model", "export-hf", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").read_text() == "mine"
