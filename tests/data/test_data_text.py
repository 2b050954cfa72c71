"""fibquant.data.text: cleaning and parsing units (offline), and the real Debian packages (model)."""
from __future__ import annotations

import io
import subprocess
import tarfile
import zlib

import pytest

from fibquant.data import text as text_module
from fibquant.data.text import (TextUnavailableError, clean_text, decode_lazyload_entry, list_texts, load_text,
                                paragraphs, read_ar_members, read_deb_data_files, resolve_text_name,
                                strip_gutenberg)

EXPECTED = {  # canonical name -> (first paragraph, min characters, max characters)
    "emma": ("EMMA", 800_000, 950_000),
    "mansfield_park": ("MANSFIELD PARK", 800_000, 950_000),
    "northanger_abbey": ("NORTHANGER ABBEY", 380_000, 480_000),
    "persuasion": ("Persuasion", 420_000, 510_000),
    "pride_and_prejudice": ("PRIDE AND PREJUDICE", 620_000, 740_000),
    "sense_and_sensibility": ("SENSE AND SENSIBILITY", 620_000, 720_000),
    "moby_dick": ("MOBY DICK; OR THE WHALE", 1_100_000, 1_300_000),
}


# ------------------------------------------------------------------ offline units

def test_names_and_aliases_resolve():
    assert list_texts() == list(EXPECTED)
    assert resolve_text_name("prideprejudice").name == "pride_and_prejudice"
    assert resolve_text_name("Pride and Prejudice").name == "pride_and_prejudice"
    assert resolve_text_name("sensesensibility").name == "sense_and_sensibility"
    assert resolve_text_name("moby-dick").name == "moby_dick"
    assert resolve_text_name("mobydick").name == "moby_dick"


def test_unknown_name_lists_the_available_texts():
    with pytest.raises(ValueError, match="unknown text 'ulysses'.*emma.*moby_dick"):
        load_text("ulysses")
    with pytest.raises(ValueError, match="must be a string"):
        load_text(3)


def test_clean_text_joins_lines_into_paragraphs():
    lines = ["\ufeffTITLE", "", "", "First line of a", "  paragraph  with   spaces.", "", "Second."]
    assert clean_text(lines) == "TITLE\n\nFirst line of a paragraph with spaces.\n\nSecond.\n"
    assert paragraphs(clean_text(lines)) == ["TITLE", "First line of a paragraph with spaces.", "Second.\n"]


def test_clean_text_drops_gutenberg_boilerplate():
    lines = ["The Project Gutenberg EBook of X", "licence blah", "",
             "*** START OF THIS PROJECT GUTENBERG EBOOK X ***", "", "Produced by Someone", "",
             "CHAPTER 1", "", "Call me", "Ishmael.", "", "End of Project Gutenberg's X", "more licence"]
    assert clean_text(lines) == "CHAPTER 1\n\nCall me Ishmael.\n"
    assert strip_gutenberg(["a", "b"]) == ["a", "b"]  # no markers: everything kept


def test_transcriber_notes_are_dropped_up_to_the_next_heading():
    lines = ["BOOK", "", "Original Transcriber's Notes:", "", "We changed the pound sign.", "", "ETYMOLOGY.", "",
             "Whale."]
    assert clean_text(lines) == "BOOK\n\nETYMOLOGY.\n\nWhale.\n"


def test_clean_text_rejects_empty_books():
    with pytest.raises(ValueError, match="empty"):
        clean_text(["", "  ", ""])


def test_lazyload_entry_errors_are_clear():
    with pytest.raises(ValueError, match="too short"):
        decode_lazyload_entry(b"\x00\x00")
    with pytest.raises(ValueError, match="does not decompress"):
        decode_lazyload_entry(b"\x00\x00\x00\x10" + b"definitely not zlib")
    body = zlib.compress(b"abc")
    with pytest.raises(ValueError, match="length mismatch"):
        decode_lazyload_entry(b"\x00\x00\x00\x09" + body)


def _ar(members: dict[str, bytes]) -> bytes:
    out = [b"!<arch>\n"]
    for name, data in members.items():
        out.append(f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}".encode() + b"`\n" + data)
        if len(data) % 2:
            out.append(b"\n")
    return b"".join(out)


def _tar_xz(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_deb_container_is_parsed_without_dpkg():
    data = _tar_xz({"./usr/lib/R/site-library/p/data/Rdata.rdx": b"INDEX",
                    "./usr/lib/R/site-library/p/data/Rdata.rdb": b"DB!"})  # odd size: ar padding
    deb = _ar({"debian-binary": b"2.0\n", "control.tar.xz": b"x", "data.tar.xz": data})
    assert read_ar_members(deb)["debian-binary"] == b"2.0\n"
    found = read_deb_data_files(deb, ("/data/Rdata.rdx", "/data/Rdata.rdb"))
    assert sorted(found.values()) == [b"DB!", b"INDEX"]
    with pytest.raises(ValueError, match="no /data/missing"):
        read_deb_data_files(deb, ("/data/missing",))
    with pytest.raises(ValueError, match="not an ar archive"):
        read_ar_members(b"PK\x03\x04 a zip file")
    with pytest.raises(ValueError, match="truncated"):
        read_ar_members(deb[:-5])


def test_missing_apt_get_names_package_and_command(tmp_path, monkeypatch):
    monkeypatch.setattr(text_module.shutil, "which", lambda name: None)
    with pytest.raises(TextUnavailableError, match=r"r-cran-janeaustenr.*apt-get update && apt-get download"):
        load_text("emma", cache_dir=tmp_path)


def test_failed_download_retries_after_update_then_explains(tmp_path, monkeypatch):
    calls = []

    def failing_run(command, cwd):
        calls.append(command[1:])
        return subprocess.CompletedProcess(command, 100, "", "E: Unable to locate package")

    monkeypatch.setattr(text_module.shutil, "which", lambda name: "/usr/bin/apt-get")
    monkeypatch.setattr(text_module, "_run", failing_run)
    with pytest.raises(TextUnavailableError, match=r"r-cran-tokenizers \(E: Unable to locate package\).*"
                                                   r"apt-get update && apt-get download r-cran-tokenizers"):
        load_text("moby_dick", cache_dir=tmp_path)
    assert calls == [["download", "r-cran-tokenizers"], ["update"], ["download", "r-cran-tokenizers"]]


def test_corrupt_cached_deb_gives_a_clear_error(tmp_path):
    debs = tmp_path / "debs"
    debs.mkdir()
    bad = debs / "r-cran-janeaustenr_1.0.0-1_all.deb"
    bad.write_bytes(b"!<arch>\nthis is not a real member header")
    with pytest.raises(TextUnavailableError, match=r"r-cran-janeaustenr_1.0.0-1_all.deb is damaged.*delete it"):
        load_text("emma", cache_dir=tmp_path)


# ------------------------------------------------------------------ the real packages

@pytest.mark.model
@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_real_text_loads_and_is_clean(name):
    title, low, high = EXPECTED[name]
    text = load_text(name)
    parts = paragraphs(text)
    assert low <= len(text) <= high
    assert parts[0] == title
    assert len(parts) > 900
    assert "Gutenberg" not in text and "\r" not in text and "\ufeff" not in text
    assert all(part.strip() == part and part for part in parts[:-1])  # no empty or padded paragraphs
    assert max(len(part) for part in parts) < 20_000  # lines were joined at empty lines only
    assert load_text(name) == text  # the cached copy is identical


@pytest.mark.model
def test_corrupt_cached_rdb_gives_a_clear_error(tmp_path):
    load_text("persuasion")  # makes sure the real package is cached
    real = text_module.text_cache_dir() / "r-cran-janeaustenr" / "data"
    damaged = tmp_path / "r-cran-janeaustenr" / "data"
    damaged.mkdir(parents=True)
    (damaged / "Rdata.rdx").write_bytes((real / "Rdata.rdx").read_bytes())
    (damaged / "Rdata.rdb").write_bytes((real / "Rdata.rdb").read_bytes()[:1000])  # truncated
    with pytest.raises(TextUnavailableError, match="truncated.*damaged"):
        load_text("persuasion", cache_dir=tmp_path)
    (damaged / "Rdata.rdx").write_bytes(b"\x1f\x8b garbage")
    with pytest.raises(TextUnavailableError, match="not a valid R lazy-load index"):
        load_text("persuasion", cache_dir=tmp_path)
