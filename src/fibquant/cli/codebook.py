"""`fibquant codebook build|info`: prebuild universal codebooks into the cache, list them."""
from __future__ import annotations

import argparse
from pathlib import Path

from ._common import add_list_argument


def register(subparsers) -> None:
    parser = subparsers.add_parser("codebook", help="build or inspect universal FibQuant codebooks")
    sub = parser.add_subparsers(dest="codebook_command", required=True)

    build = sub.add_parser("build", help="build (or load) codebooks and store them as safetensors")
    build.add_argument("--dim", type=int, required=True, help="vector dimension d")
    build.add_argument("--k", type=int, help="block size k (divides d)")
    build.add_argument("--n", type=int, help="number of codewords N")
    add_list_argument(build, "--rates", type=float, metavar="B",
                      help="instead of --k/--n: the (k, N) FibQuantCodec.for_rate picks for these bit rates")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--recipe", default=None, metavar="VERSION",
                       help="rebuild with this construction version (e.g. v2) instead of loading; default: "
                            "load the shipped/cached file or build the current version")
    build.add_argument("--out", type=Path, default=None,
                       help="also copy the files to this folder (default: only the cache)")
    build.set_defaults(func=_build)

    info = sub.add_parser("info", help="list shipped and cached codebooks")
    info.set_defaults(func=_info)


def _build(args: argparse.Namespace) -> int:
    from fibquant.codebook import build_codebook, load_codebook, save_codebook
    from fibquant.codecs.fibquant import choose_block

    if args.rates:
        pairs = [choose_block(args.dim, rate) for rate in args.rates]
    elif args.k is not None and args.n is not None:
        pairs = [(args.k, args.n)]
    else:
        raise ValueError("give --k and --n, or --rates")
    for k, n in pairs:
        if args.recipe is None:
            codebook = load_codebook(args.dim, k, n, args.seed, progress=True)
        else:
            codebook = build_codebook(args.dim, k, n, args.seed, progress=True, version=args.recipe)
        line = (f"d={args.dim} k={k} N={n} seed={args.seed} {codebook.version}: "
                f"{codebook.bits_per_coordinate:.4g} bits/coord, MSE estimate {codebook.total_mse:.5g}, "
                f"build {codebook.build_seconds:.1f} s")
        if args.out is not None:
            line += f" -> {save_codebook(codebook, args.out / codebook.file_name)}"
        print(line, flush=True)
    return 0


def _info(args: argparse.Namespace) -> int:
    from fibquant.codebook import read_codebook
    from fibquant.codebook.store import SHIPPED_DIR, cache_dir

    for label, folder in (("shipped", SHIPPED_DIR), ("cache", cache_dir())):
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
        print(f"{label}: {folder} ({len(files)} codebooks)")
        for path in files:
            cb = read_codebook(path)
            s = cb.spec
            print(f"  d={s.dim:<4} k={s.k:<3} N={s.n_codewords:<5} seed={s.seed} {cb.version} "
                  f"{cb.bits_per_coordinate:.4g} bits/coord  MSE estimate {cb.total_mse:.5g}  "
                  f"{path.stat().st_size / 1024:.0f} KiB")
    return 0
