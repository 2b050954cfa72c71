"""`fibquant cache` and `fibquant archive`: every misuse is one line, caught before any long work,
and leaves nothing behind; `cache info` verifies the payload and reports a recovery in one line."""
from __future__ import annotations

import re

import pytest
import torch

from _kv_helpers import held_by_another_process, tiny_llama
from fibquant.archive import Archive
from fibquant.cli import main
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.integer import IntCodec
from fibquant.kv.attention.switch import attention_on_codes
from fibquant.kv.cache import CompressedCache
from fibquant.kv.model import cache_kwarg
from fibquant.kv.persist.store import save_cache

UNWRITABLE = "/proc/fibquant-out"  # /proc takes no new files, even for root


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A small saved cache (tiny model) for the commands that read one."""
    model = tiny_llama(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    cache = CompressedCache.for_model(model, FibQuantCodec.for_rate(64, 2.0), IntCodec(64, 4), 4, 8, encode_batch=4)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), attention_on_codes(model):
        model(input_ids=ids, **cache_kwarg(model, cache), use_cache=True)
    path = tmp_path_factory.mktemp("saved") / "c"
    save_cache(cache, path, model, ids)
    return path


def _one_line_error(capsys, argv, code=2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.startswith("fibquant: error:") and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv, message", [
    (["cache", "save", "{tmp}/out", "--prompt", ""], "--prompt is empty"),
    (["cache", "save", "{tmp}/out", "--prompt", "   "], "--prompt is empty"),
    (["cache", "save", "{tmp}/out", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["cache", "save", "{tmp}/out", "--prompt", "hi", "--checkpoint-every", "0"], "--checkpoint-every must be"),
    (["cache", "save", "{tmp}/missing/out", "--prompt", "hi"], "folder .*missing does not exist"),
    (["cache", "save", UNWRITABLE, "--prompt", "hi"], "cannot write in the folder /proc"),
    (["cache", "save", "{file}", "--prompt", "hi", "--overwrite"], "is a file, not a saved cache folder"),
    (["cache", "save", "{saved}", "--prompt", "hi"], "exists .pass --overwrite"),
    (["cache", "info", "{file}"], "is a file, not a saved KV cache"),
    (["cache", "generate", "{file}"], "is a file, not a saved KV cache"),
    (["cache", "info", "{tmp}/missing"], "no saved KV cache here"),
    (["cache", "info", "{folder_manifest}"], "manifest.json is a folder"),
    (["cache", "info", "{binary_manifest}"], "corrupt manifest.json .not UTF-8"),
    (["cache", "generate", "{saved}", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["cache", "generate", "{saved}", "--checkpoint-every", "0"], "--checkpoint-every must be at least 1"),
    (["archive", "pack", "{file}", "{tmp}/a.fqa", "--alphabet", "0"], "--alphabet must be at least 2"),
    (["archive", "pack", "{file}", "{tmp}/a.fqa", "--alphabet", "-5"], "--alphabet must be at least 2"),
    (["archive", "pack", "{file}", "{tmp}/a.fqa", "--alphabet", "50"], r"symbols must lie in \[0, 50\)"),
    (["archive", "pack", "{file}", "{tmp}/missing/a.fqa"], "folder .*missing does not exist"),
    (["archive", "pack", "{file}", "{tmp}"], "is a folder, not a file"),
    (["eval", "archive-bench", "--quick", "--out", UNWRITABLE], "cannot write in the folder /proc"),
])
def test_misuse_is_one_line_before_any_work_and_leaves_nothing(tmp_path, capsys, saved, argv, message):
    work = tmp_path / "work"
    work.mkdir()
    (work / "img.png").write_bytes(b"\x89PNG\r\n")
    (work / "folder").mkdir()
    (work / "folder/manifest.json").mkdir()
    (work / "binary").mkdir()
    (work / "binary/manifest.json").write_bytes(b"\xa2\xff{")
    before = sorted(p.relative_to(work) for p in work.rglob("*"))
    argv = [arg.format(tmp=work, file=work / "img.png", saved=saved, folder_manifest=work / "folder",
                       binary_manifest=work / "binary") for arg in argv]
    err = _one_line_error(capsys, argv)
    assert re.search(message, err), err
    assert sorted(p.relative_to(work) for p in work.rglob("*")) == before  # nothing left behind


def test_cache_info_verifies_the_payload_unless_told_not_to(saved, tmp_path, capsys):
    import json
    import shutil

    path = tmp_path / "c"
    shutil.copytree(saved, path)
    assert main(["cache", "info", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["verified_blocks"] > 0
    raw = bytearray((path / "values/bytes.fqa").read_bytes())
    raw[200] ^= 0x10
    (path / "values/bytes.fqa").write_bytes(bytes(raw))
    assert "checksum mismatch in block" in _one_line_error(capsys, ["cache", "info", str(path)])
    assert main(["cache", "info", str(path), "--no-verify"]) == 0  # headers only: it looks healthy
    assert "verified_blocks" not in json.loads(capsys.readouterr().out)


def test_cache_info_reports_a_recovery_in_one_line(saved, tmp_path, capsys):
    import shutil

    path = tmp_path / "c"
    shutil.copytree(saved, path)
    indices = path / "keys/indices.fqa"
    with open(indices, "r+b") as handle:
        handle.truncate(indices.stat().st_size - 50)
    assert main(["cache", "info", str(path)]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fibquant: warning:") and "recovered" in lines[0]


def test_archive_pack_refuses_while_another_process_writes(tmp_path, capsys):
    source, target = tmp_path / "in.txt", tmp_path / "out.fqa"
    source.write_bytes(b"hello world")
    assert main(["archive", "pack", str(source), str(target)]) == 0
    before = target.read_bytes()
    with held_by_another_process(f"from fibquant.archive import Archive\ns = Archive.open({str(target)!r}, 'a')"):
        capsys.readouterr()
        err = _one_line_error(capsys, ["archive", "pack", str(source), str(target), "--overwrite"])
        assert f"{target} is being written by another process" in err
        with Archive.open(target) as reader:  # readers are not blocked
            assert len(reader) == len(b"hello world")
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.fqa"]


def test_archive_overwrite_replaces_only_when_complete(tmp_path):
    target = tmp_path / "a.fqa"
    with Archive.create(target, 16) as archive:
        archive.append([1, 2, 3])
    before = target.read_bytes()
    with pytest.raises(ValueError, match="symbols must lie"):
        with Archive.create(target, 16, overwrite=True) as archive:
            archive.append([4, 5])
            assert target.read_bytes() == before  # built aside meanwhile
            archive.append([99])
    assert target.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["a.fqa"]
    with Archive.create(target, 16, overwrite=True) as archive:
        archive.append([7])
    with Archive.open(target) as archive:
        assert archive.read().tolist() == [7]


@pytest.mark.parametrize("argv", [["cache", "generate", "{c}"], ["cache", "save", "{c}", "--prompt", "hi", "--overwrite"]])
def test_a_second_cache_writer_is_refused_before_the_model_loads(saved, tmp_path, capsys, argv):
    import shutil

    path = tmp_path / "c"
    shutil.copytree(saved, path)
    opening = f"from fibquant.kv.persist.store import PersistentCache\ns = PersistentCache.open({str(path)!r}, 'a')"
    with held_by_another_process(opening):
        err = _one_line_error(capsys, [arg.format(c=path) for arg in argv])
        assert f"{path} is being written by another process" in err
