"""`fibquant archive pack|get|search|info`: arguments in, public API called, clear errors."""
import json
import re

import numpy as np
import pytest

from fibquant.archive import Archive
from fibquant.cli import main

TEXT = b"It is a truth universally acknowledged, that a single man in possession of a good fortune, " \
       b"must be in want of a wife. A truth!"


def test_pack_get_search_info(tmp_path, capsys):
    source = tmp_path / "novel.txt"
    source.write_bytes(TEXT)
    target = tmp_path / "novel.fqa"
    assert main(["archive", "pack", str(source), str(target)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["alphabet_size"] == 256 and info["symbols"] == len(TEXT)
    with Archive.open(target) as archive:
        assert bytes(archive.read().tolist()) == TEXT

    assert main(["archive", "get", str(target), "8:13", "--text"]) == 0
    assert capsys.readouterr().out.strip() == "truth"
    assert main(["archive", "get", str(target), "0"]) == 0
    assert capsys.readouterr().out.strip() == str(TEXT[0])

    assert main(["archive", "search", str(target), "--text", "truth", "--context", "7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "2 matches"
    ends = [TEXT.find(b"truth") + 4, TEXT.rfind(b"truth") + 4]
    assert [int(line.split("\t")[0]) for line in lines[1:]] == ends
    assert lines[1].split("\t")[1] == "a truth"

    assert main(["archive", "info", str(target)]) == 0
    assert json.loads(capsys.readouterr().out)["file_bytes"] == target.stat().st_size


def test_pack_npy_with_float_variant(tmp_path, capsys):
    symbols = np.random.default_rng(0).integers(0, 4096, 3000)
    np.save(tmp_path / "s.npy", symbols)
    assert main(["archive", "pack", str(tmp_path / "s.npy"), str(tmp_path / "s.fqa"), "--variant", "float"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["variant"] == "float" and info["alphabet_size"] == int(symbols.max()) + 1
    assert main(["archive", "search", str(tmp_path / "s.fqa"), *map(str, symbols[100:104])]) == 0
    assert "103" in capsys.readouterr().out.splitlines()[1:]  # a match is named by its end position
    with Archive.open(tmp_path / "s.fqa") as archive:
        assert np.array_equal(archive.read(), symbols)


@pytest.mark.parametrize("argv, message", [
    (["archive", "info", "missing.fqa"], "cannot open archive"),
    (["archive", "get", "{archive}", "x"], "index must be"),
    (["archive", "search", "{archive}", "999"], r"\[0, 256\)"),
    (["archive", "search", "{archive}"], "as symbols or with --text"),
    (["archive", "pack", "missing.txt", "{tmp}/o.fqa"], "no such input"),
    (["archive", "get", "{archive}", "99999"], r"index 99999 out of range .*length 3$"),
    (["archive", "get", "{archive}", "-4"], r"index -4 out of range .*length 3$"),
    (["archive", "get", "{tmp}", "0"], "cannot open archive"),
    (["archive", "get", "missing.fqa", "0"], "cannot open archive"),
    (["archive", "search", "{archive}", "1", "--limit", "-1"], "--limit must be a non-negative"),
    (["archive", "search", "{archive}", "1", "--context", "-2"], "--context must be a non-negative"),
    (["archive", "info", "{foreign}"], "not a fibquant archive"),
    (["archive", "get", "{short}", "0"], "truncated archive header"),
])
def test_errors_are_one_line_messages(tmp_path, capsys, argv, message):
    archive = tmp_path / "a.fqa"
    with Archive.create(archive, 256) as a:
        a.append([1, 2, 3])
    (tmp_path / "foreign.fqa").write_bytes(TEXT)
    (tmp_path / "short.fqa").write_bytes(archive.read_bytes()[:10])
    argv = [arg.format(archive=archive, tmp=tmp_path, foreign=tmp_path / "foreign.fqa", short=tmp_path / "short.fqa")
            for arg in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fibquant: error:") and len(err.strip().splitlines()) == 1
    assert re.search(message, err)


def test_torn_archive_warns_in_one_line_and_errors_in_one_line(tmp_path, capsys):
    """A file cut mid-block: the torn tail is dropped with one warning line; reads past the
    recovered length are one-line errors naming the index and the length."""
    source, target = tmp_path / "novel.txt", tmp_path / "novel.fqa"
    source.write_bytes(TEXT)
    assert main(["archive", "pack", str(source), str(target)]) == 0
    capsys.readouterr()
    target.write_bytes(target.read_bytes()[:target.stat().st_size - 5])
    assert main(["archive", "get", str(target), "3"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("fibquant: warning:") and "dropped" in lines[0]
    assert lines[1] == f"fibquant: error: index 3 out of range for archive {target} of length 0"


def _strict_loads(text: str):
    """json.loads that rejects NaN / Infinity (not JSON) instead of reading them as floats."""
    def reject(token):
        raise AssertionError(f"{token} is not valid JSON")
    return json.loads(text, parse_constant=reject)


def test_info_of_an_empty_archive_is_valid_json_with_null_bits_per_symbol(tmp_path, capsys):
    target = tmp_path / "empty.fqa"
    Archive.create(target, 256).close()
    assert main(["archive", "info", str(target)]) == 0
    info = _strict_loads(capsys.readouterr().out)
    assert info["symbols"] == 0 and info["bits_per_symbol"] is None
