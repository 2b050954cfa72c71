"""`fibquant archive pack|get|search|info` and `fibquant eval archive-bench [--quick]`."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np

from .. import _json as strict_json
from ._common import add_threads_argument, apply_threads, run_experiment


def _read_symbols(path: Path, input_format: str) -> tuple[np.ndarray, int]:
    """(symbols, default alphabet size) of a .npy of ints or of any file read as bytes."""
    if not path.is_file():
        raise ValueError(f"no such input file: {path}")
    if input_format == "auto":
        input_format = "npy" if path.suffix == ".npy" else "bytes"
    if input_format == "npy":
        symbols = np.load(path, allow_pickle=False)
        return symbols, (int(symbols.max()) + 1 if symbols.size and symbols.dtype.kind in "iu" else 2)
    return np.frombuffer(path.read_bytes(), dtype=np.uint8), 256


def _pack(args) -> int:
    from fibquant.archive import Archive

    symbols, alphabet = _read_symbols(Path(args.input), args.input_format)
    alphabet = alphabet if args.alphabet is None else args.alphabet
    with Archive.create(args.output, max(2, alphabet), variant=args.variant, overwrite=args.overwrite) as archive:
        archive.append(symbols)
    with Archive.open(args.output) as archive:
        _print_info(archive.info())
    return 0


def _open(path):
    """Archive.open(path) for reading; a recovered torn tail (RecoveryWarning) is one stderr line."""
    from fibquant.archive import Archive, RecoveryWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RecoveryWarning)
        archive = Archive.open(path)
    for warning in caught:
        if issubclass(warning.category, RecoveryWarning):
            print(f"fibquant: warning: {warning.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return archive


def _parse_range(text: str) -> slice | int:
    if ":" in text:
        start, _, stop = text.partition(":")
        return slice(int(start) if start else None, int(stop) if stop else None)
    return int(text)


def _show(symbols, as_text: bool) -> str:
    values = [int(s) for s in np.atleast_1d(symbols)]
    if as_text:
        return bytes(values).decode("utf-8", errors="replace")
    return " ".join(map(str, values))


def _get(args) -> int:
    try:
        where = _parse_range(args.index)
    except ValueError:
        raise ValueError(f"index must be an int or start:stop, got {args.index!r}") from None
    with _open(args.archive) as archive:
        if isinstance(where, int) and not -len(archive) <= where < len(archive):
            raise ValueError(f"index {where} out of range for archive {args.archive} of length {len(archive)}")
        print(_show(archive[where], args.text))
    return 0


def _search(args) -> int:
    if (args.text is None) == (not args.symbols):
        raise ValueError("give the query as symbols or with --text, not both")
    for flag, value in (("--context", args.context), ("--limit", args.limit)):
        if value < 0:
            raise ValueError(f"{flag} must be a non-negative int, got {value}")
    query = list(args.text.encode("utf-8")) if args.text is not None else args.symbols
    with _open(args.archive) as archive:
        hits = archive.search(query)
        print(f"{hits.size} matches")
        for position in hits[:args.limit].tolist():
            line = f"{position}"
            if args.context:
                line += "\t" + _show(archive.context(position, args.context), args.text is not None)
            print(line)
    return 0


def _print_info(info: dict) -> None:
    print(strict_json.dumps(info, indent=1))


def _info(args) -> int:
    with _open(args.archive) as archive:
        _print_info(archive.info())
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser("archive", help="fractal archive of a symbol stream")
    sub = parser.add_subparsers(dest="archive_command", required=True)
    pack = sub.add_parser("pack", help="store a symbol stream (.npy of ints, or any file as bytes)")
    pack.add_argument("input")
    pack.add_argument("output")
    pack.add_argument("--alphabet", type=int, default=None, help="N (default: 256 for bytes, max+1 for .npy)")
    pack.add_argument("--input-format", choices=["auto", "npy", "bytes"], default="auto")
    pack.add_argument("--variant", choices=["exact", "float"], default="exact")
    pack.add_argument("--overwrite", action="store_true")
    pack.set_defaults(func=_pack)
    get = sub.add_parser("get", help="print symbol i or the symbols start:stop")
    get.add_argument("archive")
    get.add_argument("index", help="i, or start:stop")
    get.add_argument("--text", action="store_true", help="print the symbols as UTF-8 bytes")
    get.set_defaults(func=_get)
    search = sub.add_parser("search", help="end positions of every occurrence of a query")
    search.add_argument("archive")
    search.add_argument("symbols", nargs="*", type=int)
    search.add_argument("--text", default=None, help="query as a UTF-8 string (byte archives)")
    search.add_argument("--context", type=int, default=0, help="also print this many symbols ending at each hit")
    search.add_argument("--limit", type=int, default=20)
    search.set_defaults(func=_search)
    info = sub.add_parser("info", help="header and size figures")
    info.add_argument("archive")
    info.set_defaults(func=_info)


def register_eval(eval_subparsers) -> None:
    parser = eval_subparsers.add_parser("archive-bench", help="fractal archive benchmark (table, JSON, plot)")
    parser.add_argument("--quick", action="store_true", help="10^5 symbols per stream")
    parser.add_argument("--out", default=None,
                        help="output folder (default $FIBQUANT_RESULTS_DIR/archive, else ./results/archive)")
    add_threads_argument(parser)
    parser.set_defaults(func=_eval)


def eval_out_dir(out) -> Path:
    """`--out`, else `<results directory>/archive` (fibquant.paths)."""
    from fibquant.paths import results_root

    return Path(out) if out else results_root() / "archive"


def _eval(args) -> int:
    from fibquant.eval.archive.bench import config_for

    config = config_for(args.quick)
    apply_threads(args)
    run_experiment("archive-bench", config, eval_out_dir(args.out))
    return 0
