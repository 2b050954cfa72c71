"""Small JSON metadata files with a checksum per field (a cache's manifest.json, a code archive's
layout.json): every field's sha256 (first 16 hex digits) is written under "checksums", and
`read_checked_json` refuses a file whose fields do not match them, naming the fields. An edit
that leaves valid JSON is thus refused like a flipped byte; the files stay readable by hand.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .format import ArchiveCorruptError

CHECKSUMS = "checksums"


def _field_sum(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def with_checksums(data: dict) -> dict:
    """`data` plus its per-field checksums."""
    body = {k: v for k, v in data.items() if k != CHECKSUMS}
    return {**body, CHECKSUMS: {k: _field_sum(v) for k, v in body.items()}}


def check_fields(data: dict, where) -> dict:
    """`data` without its checksums; ArchiveCorruptError naming every field that differs from them."""
    sums = data.get(CHECKSUMS)
    if not isinstance(sums, dict):
        raise ArchiveCorruptError(f"{where}: no field checksums (\"{CHECKSUMS}\" missing or damaged)")
    body = {k: v for k, v in data.items() if k != CHECKSUMS}
    changed = sorted(k for k in set(body) | set(sums) if k not in body or sums.get(k) != _field_sum(body[k]))
    if changed:
        raise ArchiveCorruptError(f"{where}: field(s) {', '.join(changed)} do not match their checksums "
                                  "(edited or corrupt); refusing to open")
    return body


def read_json(path: Path) -> dict:
    """The JSON object in `path`; ArchiveCorruptError (naming the file) for a folder, bad bytes or bad JSON.
    FileNotFoundError is passed on."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
        data = json.loads(text)
    except IsADirectoryError:
        raise ArchiveCorruptError(f"{path} is a folder, not a JSON file") from None
    except UnicodeDecodeError as exc:
        raise ArchiveCorruptError(f"{path.parent}: corrupt {path.name} (not UTF-8 text at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ArchiveCorruptError(f"{path.parent}: corrupt {path.name} (not JSON: {exc})") from None
    if not isinstance(data, dict):
        raise ArchiveCorruptError(f"{path.parent}: corrupt {path.name} (a JSON {type(data).__name__}, not an object)")
    return data
