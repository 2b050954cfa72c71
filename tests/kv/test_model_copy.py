"""The dense copy of the default GGUF model (kv/model_copy.py): written on the first load, then loaded
instead of the GGUF, the same model bitwise; a broken copy is rebuilt; an unwritable root only warns."""
from __future__ import annotations

import json

import pytest
import torch

from fibquant.kv import model as kv_model
from fibquant.kv import model_copy
from fibquant.kv.model import DEFAULT_MODEL_NAME, default_model_file, describe_model, load_model

pytestmark = pytest.mark.model
PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture
def gguf():
    try:
        return default_model_file()
    except ValueError as exc:
        pytest.skip(str(exc))


def _same_model(a, b, buffers=True):
    assert sorted(n for n, _ in a.named_parameters()) == sorted(n for n, _ in b.named_parameters())
    for (name, x), (_, y) in zip(sorted(a.named_parameters()), sorted(b.named_parameters())):
        assert x.dtype == y.dtype and torch.equal(x, y), name
    for (name, x), (_, y) in zip(sorted(a.named_buffers()), sorted(b.named_buffers()), strict=True):
        assert not buffers or torch.equal(x, y), name


def test_first_load_writes_the_copy_and_later_loads_equal_the_gguf(gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("FIBQUANT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(model_copy.COPY_ENV, "0")
    direct, direct_tokenizer = load_model()  # the GGUF itself, as before copies existed
    assert not (tmp_path / "models").exists()
    monkeypatch.setenv(model_copy.COPY_ENV, "1")
    first, _ = load_model()
    copy = model_copy.copy_dir(gguf)
    assert model_copy.is_complete(copy, gguf) and copy.parent == tmp_path / "models"
    assert json.loads((copy / model_copy.MARKER).read_text())["gguf"] == gguf.name

    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF was read although a complete copy exists")

    monkeypatch.setattr(kv_model, "_read_gguf", no_gguf)
    again, tokenizer = load_model()
    for model in (first, again):
        _same_model(direct, model)
        assert describe_model(model) == DEFAULT_MODEL_NAME
    ids = direct_tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    assert torch.equal(tokenizer(PROMPT, return_tensors="pt")["input_ids"], ids)
    assert tokenizer.chat_template == direct_tokenizer.chat_template
    with torch.no_grad():
        assert torch.equal(again(ids).logits, direct(ids).logits)
    half, _ = load_model(dtype=torch.bfloat16)
    # .to() also casts the rotary buffer, which a bfloat16 load keeps in float32: weights only.
    _same_model(direct.to(torch.bfloat16), half, buffers=False)


def test_a_truncated_copy_is_rebuilt_and_an_unwritable_root_only_warns(gguf, tmp_path, monkeypatch):
    """The GGUF reader is replaced by a tiny model and tokenizer read from a real copy's folder, so that
    the rebuild and the unwritable root cost no GGUF parse (the copy's equality is the test above)."""
    from _kv_helpers import tiny_llama
    from transformers import AutoTokenizer

    tokenizer_source = tmp_path / "tokenizer"
    load_model()[1].save_pretrained(tokenizer_source)  # through the user's copy (written once by any real-model test)
    reference, tokenizer = tiny_llama(), AutoTokenizer.from_pretrained(tokenizer_source)
    reads = []

    def read_gguf(path, dtype, dense):
        reads.append(dense)
        return reference, tokenizer

    monkeypatch.setattr(kv_model, "_read_gguf", read_gguf)
    monkeypatch.setenv("FIBQUANT_CACHE_DIR", str(tmp_path / "second"))
    load_model()
    copy = model_copy.copy_dir(gguf)
    assert model_copy.is_complete(copy, gguf) and reads == [True]
    weights = next(copy.glob("*.safetensors"))
    head = weights.read_bytes()[:1000]
    weights.unlink()  # a new, truncated file (truncating a file a loaded model maps: SIGBUS)
    weights.write_bytes(head)
    with pytest.warns(UserWarning, match="failed to load .* rebuilding it from the GGUF"):
        rebuilt, _ = load_model()
    _same_model(reference, rebuilt)
    assert model_copy.is_complete(copy, gguf) and weights.stat().st_size > 1000 and reads == [True, True]

    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("FIBQUANT_CACHE_DIR", str(blocked))
    with pytest.warns(UserWarning, match="could not write the dense model copy"):
        unwritten, _ = load_model(dtype=torch.bfloat16)
    assert reads == [True, True, True] and next(unwritten.parameters()).dtype == torch.bfloat16
    assert blocked.read_text() == "not a folder"


def test_marker_of_another_file_or_version_is_not_complete(gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("FIBQUANT_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "copy"
    folder.mkdir()
    assert not model_copy.is_complete(folder, gguf)  # no marker
    marker = model_copy._marker(gguf)
    for key, other in (("sha256", "0" * 64), ("transformers", "0.0.1")):
        (folder / model_copy.MARKER).write_text(json.dumps(dict(marker, **{key: other})))
        assert not model_copy.is_complete(folder, gguf)
    (folder / model_copy.MARKER).write_text(json.dumps(marker))
    assert model_copy.is_complete(folder, gguf)
    (folder / model_copy.MARKER).write_text("{truncated")
    assert not model_copy.is_complete(folder, gguf)
    monkeypatch.setenv(model_copy.COPY_ENV, "off")
    assert model_copy.copy_dir(gguf) is None


def test_two_writers_racing_for_one_copy_both_succeed_and_leave_the_winners(gguf, tmp_path, model_and_tokenizer):
    """Two processes loading the model for the first time at once (pytest-xdist workers, two CLI calls) both
    write the copy: here the second writer runs to completion while the first is still staging, so the
    first one's rename finds a complete copy in place. Neither fails, the copy is the winner's, whole, and
    no staging folder is left behind."""
    from _kv_helpers import tiny_llama

    tokenizer = model_and_tokenizer[1]
    directory = tmp_path / "models" / "copy"
    first, second = tiny_llama(seed=1), tiny_llama(seed=2)
    results = []
    save = first.save_pretrained

    def save_then_lose_the_race(staging, **kwargs):
        save(staging, **kwargs)
        results.append(("second", model_copy.write_copy(directory, gguf, second, tokenizer)))

    first.save_pretrained = save_then_lose_the_race
    results.append(("first", model_copy.write_copy(directory, gguf, first, tokenizer)))
    assert results == [("second", True), ("first", True)]
    assert model_copy.is_complete(directory, gguf)
    assert [p.name for p in directory.parent.iterdir()] == ["copy"]  # both staging folders removed
    loaded, _ = kv_model._load_pretrained(directory, torch.float32)
    _same_model(second, loaded)


def test_a_killed_writers_stale_staging_folder_is_removed_and_a_young_one_kept(tmp_path):
    """A writer killed mid-copy leaves `.<name>-*` behind; the next write removes it once it is older than
    STALE_STAGING_S, and leaves a younger one (another process may be writing it) and other folders alone."""
    import os
    import time

    from _kv_helpers import tiny_llama

    class Tokenizer:
        def save_pretrained(self, folder):
            (folder / "tokenizer.json").write_text("{}")

    source = tmp_path / "tiny.gguf"
    source.write_bytes(b"GGUF stand-in")
    directory = tmp_path / "models" / "tiny-copy"
    directory.parent.mkdir()
    stale, young, other = (directory.parent / name for name in (".tiny-copy-dead", ".tiny-copy-busy", ".other-dead"))
    for folder in (stale, young, other):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    old = time.time() - model_copy.STALE_STAGING_S - 60
    for folder in (stale, other):
        os.utime(folder, (old, old))
    assert model_copy.write_copy(directory, source, tiny_llama(), Tokenizer())
    assert model_copy.is_complete(directory, source)
    assert not stale.exists() and young.exists() and other.exists()
    assert sorted(p.name for p in directory.parent.iterdir()) == [".other-dead", ".tiny-copy-busy", "tiny-copy"]
