"""Real text, offline: six Jane Austen novels and Moby Dick from Debian R-data packages.

Where the text comes from
    The Debian packages `r-cran-janeaustenr` (Austen's six novels, one R character vector of
    lines per novel) and `r-cran-tokenizers` (Moby Dick, one R string holding the whole
    Project Gutenberg file) are fetched with `apt-get download` (no R, nothing installed).
    The text sits in the package's R lazy-load database:

    - `data/Rdata.rdx`: gzip-compressed R serialization of an index, a list whose
      `variables` element maps each object name to (byte offset, length) in the .rdb file;
    - `data/Rdata.rdb`: one entry per object: a 4-byte big-endian uncompressed length, then
      the zlib-compressed (or, with a type byte, bzip2/xz) R serialization of the object.

    The `rdata` package parses the R serialization.

Cleaning
    Gutenberg header/footer, the transcriber's credit and notes (if present) are dropped,
    lines are joined into paragraphs at empty lines, whitespace inside a paragraph is
    collapsed to single spaces, and the paragraphs are joined with one empty line ("\\n\\n").
    The result is cached as UTF-8
    under `<cache root>/text/<name>.<CLEANING_VERSION>.txt`, so later calls never touch apt.

Cache root: `$FIBQUANT_CACHE_DIR` if set, else `~/.cache/fibquant` (`fibquant.paths.cache_root`).
"""
from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import re
import shutil
import struct
import subprocess
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from fibquant._extras import require

from ..paths import cache_root  # re-exported: fibquant.data.bigbench imports it from here

CLEANING_VERSION = "v2"  # bump when the cleaning changes: old cached texts are then ignored


class TextUnavailableError(RuntimeError):
    """A text's Debian package could not be fetched or read."""


@dataclass(frozen=True)
class TextSource:
    """One book: its canonical name, the Debian package and the R object holding it."""

    name: str
    title: str
    author: str
    package: str
    r_object: str

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z_]+", self.name):
            raise ValueError(f"text name must be lower-case letters and '_', got {self.name!r}")
        if not self.package.startswith("r-cran-"):
            raise ValueError(f"expected a Debian r-cran-* package, got {self.package!r}")


_AUSTEN = "r-cran-janeaustenr"
TEXTS: dict[str, TextSource] = {
    source.name: source
    for source in (
        TextSource("emma", "Emma", "Jane Austen", _AUSTEN, "emma"),
        TextSource("mansfield_park", "Mansfield Park", "Jane Austen", _AUSTEN, "mansfieldpark"),
        TextSource("northanger_abbey", "Northanger Abbey", "Jane Austen", _AUSTEN, "northangerabbey"),
        TextSource("persuasion", "Persuasion", "Jane Austen", _AUSTEN, "persuasion"),
        TextSource("pride_and_prejudice", "Pride and Prejudice", "Jane Austen", _AUSTEN, "prideprejudice"),
        TextSource("sense_and_sensibility", "Sense and Sensibility", "Jane Austen", _AUSTEN,
                   "sensesensibility"),
        TextSource("moby_dick", "Moby Dick; or The Whale", "Herman Melville", "r-cran-tokenizers",
                   "mobydick"),
    )
}


def _squash(name: str) -> str:
    return re.sub(r"[^a-z]", "", name.lower())


# Both the friendly names (any case, '-', ' ' or '_') and the R object names are accepted.
_ALIASES: dict[str, str] = {}
for _source in TEXTS.values():
    _ALIASES[_squash(_source.name)] = _source.name
    _ALIASES[_squash(_source.r_object)] = _source.name


def list_texts() -> list[str]:
    """Canonical names accepted by `load_text` (R object names work too)."""
    return list(TEXTS)


def resolve_text_name(name: str) -> TextSource:
    """The TextSource for a canonical name or an alias; ValueError listing the names otherwise."""
    if not isinstance(name, str):
        raise ValueError(f"text name must be a string, got {type(name).__name__}")
    canonical = _ALIASES.get(_squash(name))
    if canonical is None:
        raise ValueError(f"unknown text {name!r}; available: {', '.join(list_texts())}")
    return TEXTS[canonical]


def text_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir) if cache_dir is not None else cache_root() / "text"


def load_text(name: str, *, cache_dir: str | os.PathLike | None = None) -> str:
    """One book as a cleaned string: paragraphs separated by one empty line ("\\n\\n").

    The first call fetches and parses the Debian package (a few seconds); later calls read
    the cached UTF-8 file. Raises ValueError for an unknown name and TextUnavailableError
    (a RuntimeError) naming the package and the command to run when it cannot be fetched.
    """
    source = resolve_text_name(name)
    directory = text_cache_dir(cache_dir)
    cached = directory / f"{source.name}.{CLEANING_VERSION}.txt"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    data_dir = _package_data_dir(source.package, directory)
    raw = read_lazyload_object(data_dir, source.r_object)
    text = clean_text(_as_lines(raw, source))
    _write_atomically(cached, text.encode("utf-8"))
    for stale in directory.glob(f"{source.name}.v*.txt"):  # texts from an older cleaning
        if stale != cached:
            stale.unlink(missing_ok=True)
    return text


def paragraphs(text: str) -> list[str]:
    """Split a text returned by `load_text` back into its paragraphs."""
    return text.split("\n\n")


# --------------------------------------------------------------------------- cleaning

_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG", re.IGNORECASE)
_GUTENBERG_END = re.compile(r"^(\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG|End of (the )?Project Gutenberg)",
                            re.IGNORECASE)
_PRODUCER_NOTE = re.compile(r"^(Produced by|This etext was prepared by)", re.IGNORECASE)
_TRANSCRIBER_NOTE = re.compile(r"^(Original )?Transcriber'?s Notes?:?$", re.IGNORECASE)


def _is_heading(paragraph: str) -> bool:
    letters = [c for c in paragraph if c.isalpha()]
    return bool(letters) and all(c.isupper() for c in letters)


def drop_transcriber_notes(paragraphs_in: list[str]) -> list[str]:
    """Remove a "Transcriber's Notes:" block: the heading and what follows up to the next heading."""
    kept, skipping = [], False
    for paragraph in paragraphs_in:
        if _TRANSCRIBER_NOTE.match(paragraph):
            skipping = True
            continue
        if skipping and _is_heading(paragraph):
            skipping = False
        if not skipping:
            kept.append(paragraph)
    return kept


def strip_gutenberg(lines: list[str]) -> list[str]:
    """Lines between the Project Gutenberg START and END markers (all lines if none)."""
    start = next((i + 1 for i, line in enumerate(lines) if _GUTENBERG_START.match(line.strip())), 0)
    end = next((i for i in range(start, len(lines)) if _GUTENBERG_END.match(lines[i].strip())), len(lines))
    return lines[start:end]


def clean_text(lines: list[str]) -> str:
    """Lines of a book -> paragraphs joined by "\\n\\n" (see the module docstring)."""
    lines = strip_gutenberg([line.lstrip("\ufeff") for line in lines])
    result: list[str] = []
    current: list[str] = []
    for line in lines + [""]:
        if line.strip():
            current.append(line)
        elif current:
            result.append(" ".join(" ".join(current).split()))
            current = []
    # A transcriber's credit right after the START marker and transcriber notes are
    # boilerplate, not the book.
    while result and _PRODUCER_NOTE.match(result[0]):
        result.pop(0)
    result = drop_transcriber_notes(result)
    if not result:
        raise ValueError("the text is empty after cleaning")
    return "\n\n".join(result) + "\n"


def _as_lines(obj, source: TextSource) -> list[str]:
    """R character vector (numpy array of str) -> list of lines."""
    try:
        items = [str(item) for item in list(obj)]
    except TypeError as exc:
        raise TextUnavailableError(
            f"R object {source.r_object!r} in {source.package} is not a character vector "
            f"(got {type(obj).__name__})") from exc
    # Austen: one element per line; Moby Dick: one element holding the whole file. An empty
    # element is an empty line (a paragraph break), so it must survive the split.
    return [line for item in items for line in (item.splitlines() or [""])]


# --------------------------------------------------------------------------- R lazy-load DB

def read_lazyload_index(rdx: bytes) -> dict[str, tuple[int, int]]:
    """Parse `Rdata.rdx` bytes -> {object name: (offset, length) in Rdata.rdb}."""
    rdata = require("rdata", "reading the R-data texts")

    try:
        raw = gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b" else zlib.decompress(rdx[4:])
        index = rdata.conversion.convert(rdata.parser.parse_data(raw, extension=".rds"))
        variables = index["variables"]
        return {str(name): (int(pos[0]), int(pos[1])) for name, pos in variables.items()}
    except Exception as exc:  # any parse failure means a damaged index file
        raise ValueError(f"not a valid R lazy-load index (Rdata.rdx): {exc}") from exc


def decode_lazyload_entry(entry: bytes):
    """One .rdb entry (4-byte big-endian length + compressed R serialization) -> Python object."""
    rdata = require("rdata", "reading the R-data texts")

    if len(entry) < 5:
        raise ValueError(f"R lazy-load entry too short ({len(entry)} bytes)")
    (expected,) = struct.unpack(">I", entry[:4])
    body = entry[4:]
    try:
        if body[:1] == b"Z":  # R compress=3 (xz)
            data = lzma.decompress(body[1:])
        elif body[:1] == b"2":  # R compress=2 (bzip2)
            data = bz2.decompress(body[1:])
        elif body[:1] == b"0":  # stored uncompressed
            data = body[1:]
        else:  # R compress=1 (zlib), the default and what the Debian packages use
            data = zlib.decompress(body)
    except (zlib.error, lzma.LZMAError, OSError, EOFError) as exc:
        raise ValueError(f"R lazy-load entry does not decompress: {exc}") from exc
    if len(data) != expected:
        raise ValueError(f"R lazy-load entry length mismatch: header {expected}, data {len(data)}")
    return rdata.conversion.convert(rdata.parser.parse_data(data, extension=".rds"))


def read_lazyload_object(data_dir: Path, name: str):
    """The R object `name` from `data_dir/Rdata.rdx` + `Rdata.rdb`, converted by `rdata`."""
    rdx_path, rdb_path = data_dir / "Rdata.rdx", data_dir / "Rdata.rdb"
    try:
        index = read_lazyload_index(rdx_path.read_bytes())
        if name not in index:
            raise ValueError(f"object {name!r} not in the index (has {sorted(index)})")
        offset, length = index[name]
        with open(rdb_path, "rb") as handle:
            handle.seek(offset)
            entry = handle.read(length)
        if len(entry) != length:
            raise ValueError(f"Rdata.rdb is truncated: wanted {length} bytes at {offset}, got {len(entry)}")
        return decode_lazyload_entry(entry)
    except (ValueError, OSError) as exc:
        raise TextUnavailableError(
            f"cannot read R data in {data_dir}: {exc}. The cached files look damaged: delete "
            f"{data_dir.parent} and try again") from exc


# --------------------------------------------------------------------------- Debian package

def _package_data_dir(package: str, directory: Path) -> Path:
    """Directory holding the package's extracted Rdata.rdx/.rdb, fetching the .deb if needed."""
    data_dir = directory / package / "data"
    if (data_dir / "Rdata.rdx").is_file() and (data_dir / "Rdata.rdb").is_file():
        return data_dir
    deb = fetch_deb(package, directory / "debs")
    try:
        members = read_deb_data_files(deb.read_bytes(), suffixes=("/data/Rdata.rdx", "/data/Rdata.rdb"))
    except ValueError as exc:
        raise TextUnavailableError(
            f"cached Debian package {deb} is damaged ({exc}); delete it and run again to re-fetch "
            f"(`apt-get download {package}`)") from exc
    for member, content in members.items():
        _write_atomically(data_dir / member.rsplit("/", 1)[-1], content)
    return data_dir


def _write_atomically(path: Path, content: bytes) -> None:
    """Write via a per-process temporary file and rename: a killed or concurrent run never
    leaves (or reads) half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_bytes(content)
    partial.replace(path)


def _fetch_hint(package: str) -> str:
    return f"run `apt-get update && apt-get download {package}`"


def fetch_deb(package: str, debs_dir: Path) -> Path:
    """The package's .deb in `debs_dir`, downloaded with `apt-get download` if absent.

    If the download fails once, `apt-get update` is run and the download retried.
    """
    existing = sorted(debs_dir.glob(f"{package}_*.deb"))
    if existing:
        return existing[-1]
    apt = shutil.which("apt-get")
    if apt is None:
        raise TextUnavailableError(
            f"cannot fetch Debian package {package}: apt-get is not available on this machine "
            f"({_fetch_hint(package)} on a Debian/Ubuntu machine and put the .deb in {debs_dir})")
    debs_dir.mkdir(parents=True, exist_ok=True)
    attempt = _run([apt, "download", package], debs_dir)
    if attempt.returncode != 0:
        _run([apt, "update"], debs_dir)
        attempt = _run([apt, "download", package], debs_dir)
    found = sorted(debs_dir.glob(f"{package}_*.deb"))
    if attempt.returncode != 0 or not found:
        detail = (attempt.stderr or attempt.stdout or "").strip().splitlines()[-1:] or ["no output"]
        raise TextUnavailableError(
            f"cannot fetch Debian package {package} ({detail[0]}); {_fetch_hint(package)} "
            f"in {debs_dir}")
    return found[-1]


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(command, 1, "", str(exc))


def read_ar_members(archive: bytes) -> dict[str, bytes]:
    """Members of a Unix `ar` archive (the .deb container) -> {name: bytes}."""
    if not archive.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive (a .deb starts with '!<arch>')")
    members, pos = {}, 8
    while pos + 60 <= len(archive):
        header = archive[pos:pos + 60]
        if header[58:60] != b"`\n":
            raise ValueError(f"bad ar member header at byte {pos}")
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        start = pos + 60
        if start + size > len(archive):
            raise ValueError(f"ar member {name!r} is truncated")
        members[name] = archive[start:start + size]
        pos = start + size + (size & 1)  # members are 2-byte aligned
    return members


def _open_data_tar(name: str, payload: bytes) -> tarfile.TarFile:
    if name.endswith(".zst"):
        zstandard = require("zstandard", "reading a zstd-compressed package")

        payload = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(payload)).read()
        return tarfile.open(fileobj=io.BytesIO(payload), mode="r:")
    return tarfile.open(fileobj=io.BytesIO(payload), mode="r:*")  # gz, xz, bz2 or plain


def read_deb_data_files(deb: bytes, suffixes: tuple[str, ...]) -> dict[str, bytes]:
    """Files of a .deb's data.tar.* whose path ends with one of `suffixes` -> {path: bytes}."""
    members = read_ar_members(deb)
    data_name = next((name for name in members if name.startswith("data.tar")), None)
    if data_name is None:
        raise ValueError(f"no data.tar.* member in the .deb (members: {sorted(members)})")
    found: dict[str, bytes] = {}
    try:
        with _open_data_tar(data_name, members[data_name]) as tar:
            for info in tar:
                if info.isfile() and info.name.endswith(suffixes):
                    found[info.name] = tar.extractfile(info).read()
    except (tarfile.TarError, lzma.LZMAError, EOFError, OSError, zlib.error) as exc:
        raise ValueError(f"cannot read {data_name}: {exc}") from exc
    missing = [s for s in suffixes if not any(path.endswith(s) for path in found)]
    if missing:
        raise ValueError(f"the .deb has no {', '.join(missing)}")
    return found
