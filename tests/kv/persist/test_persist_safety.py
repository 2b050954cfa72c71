"""Nothing lost: one writer per cache, a checked manifest, repairs only after every check, stores
that appear complete, crash cases through a child process killed at planted points."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from _kv_helpers import edit_manifest, held_by_another_process, tiny_llama
from fibquant.archive import RecoveryWarning
from fibquant.archive.writer import StoreLockedError
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.integer import IntCodec
from fibquant.kv.persist.generate import generate_persistent, resume_generate
from fibquant.kv.persist.store import PersistentCache, save_cache

torch.set_num_threads(1)
ARCH = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
HERE = Path(__file__).resolve()
SRC, TESTS = HERE.parents[3] / "src", HERE.parents[2]
PROMPT = 20


@pytest.fixture(scope="module")
def model():
    model = tiny_llama(**ARCH)
    model.generation_config.eos_token_id = None
    return model


def _codecs():
    return FibQuantCodec.for_rate(64, 2.0), IntCodec(64, 4)


def _ids():
    return torch.randint(0, 97, (1, PROMPT), generator=torch.Generator().manual_seed(0))


def _generate(model, path, max_new_tokens=40, **kwargs):
    return generate_persistent(model, _ids(), path, *_codecs(), recent_tokens=8, encode_batch=4, checkpoint_every=8,
                               max_new_tokens=max_new_tokens, **kwargs)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """An uninterrupted run: (its directory, its token ids)."""
    path = tmp_path_factory.mktemp("ref") / "c"
    out = _generate(model, path, max_new_tokens=50)
    return path, out[0]


def digest(root: Path) -> dict:
    """sha256 of every file under root (the store's bytes), by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# A child process that runs a persistent generation and SIGKILLs itself at a planted point.
CHILD = r"""
import os, signal, sys
sys.path[:0] = [{src!r}, {tests!r}]
import torch
torch.set_num_threads(1)
from _kv_helpers import tiny_llama
from fibquant.archive import writer
from fibquant.codecs.fibquant import FibQuantCodec
from fibquant.codecs.integer import IntCodec
from fibquant.kv.persist import format as fmt, generate, store

point, path, overwrite = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
calls = {{}}

def die_at(owner, name, nth, after=False):
    real = getattr(owner, name)
    def planted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        if calls[name] == nth and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        out = real(*args, **kwargs)
        if calls[name] == nth and after:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    setattr(owner, name, planted)

if point == "before-first-checkpoint":
    die_at(store.PersistentCache, "checkpoint", 1)
elif point == "after-prefill-checkpoint":
    die_at(store.PersistentCache, "checkpoint", 1, after=True)
elif point == "torn-checkpoint":  # the second checkpoint sealed the keys, not the values nor the snapshot
    die_at(fmt.CodeStream, "close", 4)
elif point == "half-written-snapshot":  # the temporary snapshot file written, not yet renamed
    real_write = fmt.write_atomic
    def torn(target, data, durable):
        if target.name == fmt.SNAPSHOT_FILE:
            calls["snap"] = calls.get("snap", 0) + 1
            if calls["snap"] == 2:
                target.with_name(target.name + ".tmp").write_bytes(data[: len(data) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
        return real_write(target, data, durable)
    fmt.write_atomic = torn
elif point == "mid-publish":  # the old store moved aside, the new one not yet in place
    real_replace = writer.os.replace
    def replace(a, b):
        real_replace(a, b)
        if ".old-" in str(b):
            os.kill(os.getpid(), signal.SIGKILL)
    writer.os.replace = replace
elif point == "mid-repair":
    die_at(fmt, "truncate_archive", 2)

model = tiny_llama(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
model.generation_config.eos_token_id = None
if point == "mid-repair":
    generate.resume_generate(model, path, max_new_tokens=10, checkpoint_every=8)
else:
    ids = torch.randint(0, 97, (1, {prompt}), generator=torch.Generator().manual_seed(0))
    generate.generate_persistent(model, ids, path, FibQuantCodec.for_rate(64, 2.0), IntCodec(64, 4), recent_tokens=8,
                                 encode_batch=4, checkpoint_every=8, max_new_tokens=40, overwrite=overwrite)
print("finished without reaching the planted point")
"""


def crash(point: str, path: Path, overwrite: bool = False) -> None:
    """Run the child to its planted point; it must die there by SIGKILL."""
    code = CHILD.format(src=str(SRC), tests=str(TESTS), prompt=PROMPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code, point, str(path), "1" if overwrite else "0"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == -9, (done.returncode, done.stdout, done.stderr[-2000:])


def _quiet_open(path, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecoveryWarning)
        return PersistentCache.open(path, *args, **kwargs)


# ---------------------------------------------------------------------------- one writer
def test_a_second_writer_is_refused_and_readers_are_not(model, reference, tmp_path):
    path = tmp_path / "c"
    shutil.copytree(reference[0], path)
    before = digest(path)
    opening = f"from fibquant.kv.persist.store import PersistentCache\ns = PersistentCache.open({str(path)!r}, 'a')"
    with held_by_another_process(opening):
        for write in (lambda: PersistentCache.open(path, "a"), lambda: resume_generate(model, path, max_new_tokens=3),
                      lambda: _generate(model, path, overwrite=True)):
            with pytest.raises(StoreLockedError, match=f"{path}.* is being written by another process"):
                write()
        with PersistentCache.open(path) as reader:  # readers take no lock
            assert torch.equal(reader.token_ids(), reference[1])
    assert digest(path) == before  # the refused writers changed nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # the lock file went with its holder
    with PersistentCache.open(path, "a"):  # free again
        pass


# ---------------------------------------------------------------------------- checked manifest
EDITS = {"sink_tokens": 3, "recent_tokens": 4, "encode_batch": 2, "kv_heads": 1, "layers": 1, "centre": True,
         "batch": 2, "dtype": "torch.float16", "vocab_size": 96, "model_name": "other",
         "streams": {"keys": {"code_size": 18, "layout": None}, "values": {"code_size": 36, "layout": None}}}


@pytest.mark.parametrize("field", sorted(EDITS))
def test_every_valid_json_edit_of_the_manifest_is_refused_naming_the_field(model, reference, tmp_path, field):
    import json

    path = tmp_path / "c"
    shutil.copytree(reference[0], path)
    data = json.loads((path / "manifest.json").read_text())
    data[field] = EDITS[field]
    (path / "manifest.json").write_text(json.dumps(data, indent=2))
    before = digest(path)
    for attempt in (lambda: PersistentCache.open(path), lambda: PersistentCache.open(path, "a", model=model),
                    lambda: resume_generate(model, path, max_new_tokens=3)):
        with pytest.raises(ValueError, match=rf"manifest.json: field\(s\) {field} do not match their checksums"):
            attempt()
    assert digest(path) == before


def test_layout_json_edit_is_refused(reference, tmp_path):
    import json

    path = tmp_path / "c"
    shutil.copytree(reference[0], path)
    layout = json.loads((path / "keys/layout.json").read_text())
    layout["n_blocks"] = 8
    (path / "keys/layout.json").write_text(json.dumps(layout))
    with pytest.raises(ValueError, match="n_blocks do not match their checksums"):
        PersistentCache.open(path)


# ---------------------------------------------------------------------------- refused opens change nothing
def test_refused_opens_leave_a_crashed_store_byte_identical(model, reference, tmp_path):
    """A store needing a repair (codes past the last checkpoint) opened with what must be refused:
    every check runs before the repair, so no byte changes."""
    crashed = tmp_path / "crashed"
    crash("torn-checkpoint", crashed)
    with pytest.warns(RecoveryWarning):
        PersistentCache.open(crashed).close()
    cases = {
        "kv_heads re-signed": lambda p: edit_manifest(p, lambda m: m.update(kv_heads=1)),
        "another model": None,
        "snapshot missing": lambda p: (p / "exact.safetensors").unlink(),
    }
    other = tiny_llama(seed=1, **ARCH)
    for name, damage in cases.items():
        path = tmp_path / name.replace(" ", "-")
        shutil.copytree(crashed, path)
        if damage is not None:
            damage(path)
        before = digest(path)
        with pytest.raises(ValueError):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RecoveryWarning)
                resume_generate(other if name == "another model" else model, path, max_new_tokens=3)
        assert digest(path) == before, name
        with pytest.raises(ValueError):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RecoveryWarning)
                PersistentCache.open(path, "a", model=other if name == "another model" else model).close()
        assert digest(path) == before, name


# ---------------------------------------------------------------------------- atomic create / overwrite
def test_failed_create_and_overwrite_leave_nothing_or_the_old_store(model, reference, tmp_path):
    with pytest.raises(ValueError):
        _generate(model, tmp_path / "new", max_new_tokens=0)  # generate refuses before any step
    assert list(tmp_path.iterdir()) == []
    old = tmp_path / "old"
    shutil.copytree(reference[0], old)
    before = digest(old)
    with pytest.raises(ValueError):
        _generate(model, old, max_new_tokens=0, overwrite=True)
    assert digest(old) == before and sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    with pytest.raises(ValueError, match="is a file"):
        (tmp_path / "file").write_bytes(b"x")
        _generate(model, tmp_path / "file", overwrite=True)
    _generate(model, old, max_new_tokens=10, overwrite=True)  # a complete overwrite replaces it
    with PersistentCache.open(old) as store:
        assert len(store.tokens) == PROMPT + 10


# ---------------------------------------------------------------------------- crashes (child killed)
def test_crash_before_the_first_checkpoint_leaves_nothing(model, tmp_path):
    crash("before-first-checkpoint", tmp_path / "c")
    assert not (tmp_path / "c").exists()
    _generate(model, tmp_path / "c", max_new_tokens=5)  # the next writer clears the dead one's leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_the_prompt_is_checkpointed_at_the_end_of_prefill(model, reference, tmp_path):
    crash("after-prefill-checkpoint", tmp_path / "c")
    with PersistentCache.open(tmp_path / "c") as store:
        assert store.num_tokens == PROMPT and len(store.tokens) == PROMPT + 1
    out = resume_generate(model, tmp_path / "c", max_new_tokens=10)
    assert torch.equal(out[0], reference[1][: PROMPT + 11])


@pytest.mark.parametrize("point", ["torn-checkpoint", "half-written-snapshot"])
def test_crash_while_writing_recovers_and_resumes_identically(model, reference, tmp_path, point):
    crash(point, tmp_path / "c")
    with pytest.warns(RecoveryWarning) if point == "torn-checkpoint" else warnings.catch_warnings():
        store = PersistentCache.open(tmp_path / "c")
    with store:
        n = store.num_tokens
        assert n >= PROMPT and torch.equal(store.token_ids()[:n], reference[1][:n])
    out = resume_generate(model, tmp_path / "c", max_new_tokens=5)
    assert torch.equal(out[0], reference[1][: out.shape[1]])
    assert not list((tmp_path / "c").rglob("*.tmp"))  # a half-written snapshot is replaced by the next one


def test_crash_inside_the_repair_then_repair_again(model, reference, tmp_path):
    crash("torn-checkpoint", tmp_path / "c")
    expected = _quiet_open(tmp_path / "c")
    n, codes = expected.num_tokens, expected.to_cache().layers[0].key_codes.clone()
    expected.close()
    crash("mid-repair", tmp_path / "c")  # killed after cutting one stream of two
    with _quiet_open(tmp_path / "c") as store:
        assert store.num_tokens == n and torch.equal(store.to_cache().layers[0].key_codes, codes)
    out = resume_generate(model, tmp_path / "c", max_new_tokens=5)
    assert torch.equal(out[0], reference[1][: out.shape[1]])


def test_crash_while_replacing_keeps_the_old_store(model, reference, tmp_path):
    path = tmp_path / "c"
    shutil.copytree(reference[0], path)
    before = digest(path)
    crash("mid-publish", path, overwrite=True)
    assert not path.exists()  # moved aside, its replacement never arrived
    with PersistentCache.open(path, "a"):  # the next writer puts the old one back
        pass
    assert digest(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


# ---------------------------------------------------------------------------- reads of a recovered cache
def test_find_and_len_agree_on_a_recovered_cache(reference, tmp_path):
    path = tmp_path / "c"
    shutil.copytree(reference[0], path)
    with PersistentCache.open(path) as store:
        query = store.key_stream.read(0, 1)  # token 0's code in layer 0, head 0
    indices = path / "keys/indices.fqa"
    with open(indices, "r+b") as handle:  # torn: the indices lose their last record
        handle.truncate(indices.stat().st_size - 50)
    with pytest.warns(RecoveryWarning):
        store = PersistentCache.open(path)
    with store:
        stream = store.key_stream._codes  # noqa: SLF001
        assert len(stream) == min(len(stream.indices) // stream.layout.n_blocks, len(stream.norms))
        hits = store.find(query, 0, 0)
        assert 0 in hits.tolist() and all(0 <= t < store.num_coded for t in hits.tolist())


def test_verify_finds_a_flipped_code_byte(reference, tmp_path):
    path = tmp_path / "c"
    shutil.copytree(reference[0], path)
    with PersistentCache.open(path) as store:
        assert store.verify() > 0
    raw = bytearray((path / "values/bytes.fqa").read_bytes())
    raw[200] ^= 0x10
    (path / "values/bytes.fqa").write_bytes(bytes(raw))
    with PersistentCache.open(path) as store:  # opening reads headers only
        with pytest.raises(ValueError, match="corrupt payload .*checksum mismatch in block"):
            store.verify()


def test_to_cache_on_cuda_without_cuda_is_a_value_error(reference):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with PersistentCache.open(reference[0]) as store:
        with pytest.raises(ValueError, match="CUDA is not available"):
            store.to_cache(device="cuda")


def test_save_cache_overwrite_of_a_locked_store_is_refused(model, reference, tmp_path):
    path = tmp_path / "c"
    shutil.copytree(reference[0], path)
    with PersistentCache.open(path, "a") as writer:
        cache = writer.to_cache(model)
        with pytest.raises(StoreLockedError):
            save_cache(cache, path, model, writer.token_ids(), overwrite=True)
    with PersistentCache.open(path) as store:
        assert torch.equal(store.token_ids(), reference[1])
