"""Rate-distortion benchmark of the codecs on the canonical source (library side).

Total MSE E||u - u_hat||^2 of unit vectors u uniform on S^{d-1} through each codec, on FRESH
samples (a seed disjoint from every codebook's training samples), against the Shannon bound
4^-b. FibQuant on a grid of (k, N), TurboQuant at 1-4 bits, INT at 2-8 bits; encode/decode
throughput of FibQuant against TurboQuant at 2 and 4 bits; codebook build times.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fibquant.codebook import load_codebook
from fibquant.codecs import FibQuantCodec, IntCodec, TurboQuantCodec
from fibquant.codecs.fibquant import MAX_SEARCH_CODEWORDS, choose_block
from fibquant.canonical import sample_sphere
from fibquant.eval.report import Experiment, figure, format_table, format_targets
from fibquant.eval.timing import Stopwatch, rate

# Point.codec: each codec's registered name (its plot style's name), e.g. "FibQuant".
FIBQUANT, TURBOQUANT, INT = (cls.style.name for cls in (FibQuantCodec, TurboQuantCodec, IntCodec))
EVAL_SEED = 987_654_321  # the fresh test vectors; codebooks train on hash-derived seeds
FOR_RATE_GRID = (0.1875, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)
# The benchmark's targets at d = 64: FibQuant best MSE / TurboQuant MSE at 1-4 bits, absolute
# sub-one-bit MSE, and FibQuant / TurboQuant encode and decode throughput at 2 and 4 bits.
MSE_RATIO_TARGETS = {1.0: 0.87, 2.0: 0.85, 3.0: 0.85, 4.0: 0.85}
SUB_ONE_BIT_TARGETS = {0.5: 0.57, 0.1875: 0.71}
THROUGHPUT_TARGETS = {"encode": 0.3, "decode": 0.8}


@dataclass(frozen=True)
class RDConfig:
    dims: tuple[int, ...] = (64, 128)
    n_vectors: int = 1 << 16
    quick: bool = False
    build_missing: bool = True  # False: use only shipped or cached codebooks, skip the rest
    max_codewords: int = MAX_SEARCH_CODEWORDS  # lower it to skip codebooks that take long to build
    throughput_vectors: int = 1 << 15
    throughput_repeats: int = 5
    # Throughput runs on this many CPU threads (None: torch's default). One thread by default:
    # on a shared 2-core machine multi-threaded small ops are dominated by scheduling noise.
    throughput_threads: int | None = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.dims or any(not isinstance(d, int) or d < 2 for d in self.dims):
            raise ValueError(f"dims must be integers >= 2, got {self.dims!r}")
        if not 2 <= self.max_codewords <= MAX_SEARCH_CODEWORDS:
            raise ValueError(f"max_codewords must be in 2..{MAX_SEARCH_CODEWORDS}, got {self.max_codewords}")
        if self.n_vectors < 256 or self.throughput_vectors < 256:
            raise ValueError("n_vectors and throughput_vectors must be >= 256")


@dataclass
class Point:
    codec: str
    dim: int
    bits: float               # nominal index bits per coordinate
    stored_bits: float        # every stored bit (norm / scales included) per coordinate
    mse: float
    k: int | None = None
    n_codewords: int | None = None
    train_mse: float | None = None
    build_seconds: float | None = None
    best: bool = False


@dataclass
class RDReport:
    config: RDConfig
    points: list[Point] = field(default_factory=list)
    throughput: list[dict] = field(default_factory=list)
    targets: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"config": asdict(self.config), "points": [asdict(p) for p in self.points],
                "throughput": self.throughput, "targets": self.targets, "skipped": self.skipped,
                "note": "MSE = E||u - u_hat||^2 of unit vectors uniform on S^{d-1}, measured on fresh "
                        "samples (not the codebooks' training samples); Shannon bound 4^-b."}

    @classmethod
    def from_json(cls, payload: dict) -> "RDReport":
        """The report back from `to_json()` (the payload written to rate_distortion.json)."""
        config = {**payload["config"], "dims": tuple(payload["config"]["dims"])}
        return cls(RDConfig(**config), [Point(**p) for p in payload["points"]], list(payload["throughput"]),
                   list(payload["targets"]), list(payload["skipped"]))


def _as_report(report) -> RDReport:
    return report if isinstance(report, RDReport) else RDReport.from_json(report)


def fibquant_grid(dim: int, quick: bool) -> list[tuple[int, int]]:
    """(k, N) pairs: the for_rate choice at every grid rate, plus (full run) the other block sizes
    k | dim with N = 2^(bits*k) in [4, MAX_SEARCH_CODEWORDS] at the same rates."""
    pairs = []
    for bits in FOR_RATE_GRID:
        try:
            best = choose_block(dim, bits)
        except ValueError:
            continue
        pairs.append(best)
        if quick:
            continue
        for k in range(2, best[0]):
            index_bits = bits * k
            if dim % k or abs(index_bits - round(index_bits)) > 1e-9:
                continue
            n = 1 << round(index_bits)
            if 4 <= n <= MAX_SEARCH_CODEWORDS:
                pairs.append((k, n))
    return sorted(set(pairs), key=lambda kn: (math.log2(kn[1]) / kn[0], kn[0]))


def unit_mse(codec, u: torch.Tensor, batch: int = 1 << 14) -> float:
    """E||u - decode(encode(u))||^2 over rows of u [n, dim], in float64."""
    total = 0.0
    for start in range(0, u.shape[0], batch):
        chunk = u[start:start + batch]
        total += float(((codec.roundtrip(chunk) - chunk).double() ** 2).sum())
    return total / u.shape[0]


def measure_throughput(codecs: dict, u: torch.Tensor, repeats: int) -> dict[str, tuple[float, float]]:
    """{name: (encode, decode) vectors per second}, best of `repeats` on the batch u [n, dim].

    The codecs take turns within each repeat, so a busy machine slows them alike.
    """
    best = {name: [math.inf, math.inf] for name in codecs}
    for codec in codecs.values():  # warm-up: tables onto the device, search structures, allocator
        codec.decode(codec.encode(u[:256]))
    for _ in range(repeats):
        for name, codec in codecs.items():
            with Stopwatch() as encode:
                codes = codec.encode(u)
            with Stopwatch() as decode:
                codec.decode(codes)
            best[name][0] = min(best[name][0], encode.seconds)
            best[name][1] = min(best[name][1], decode.seconds)
    return {name: (rate(enc, u.shape[0]), rate(dec, u.shape[0])) for name, (enc, dec) in best.items()}


def run_rate_distortion(config: RDConfig) -> RDReport:
    report = RDReport(config)
    for dim in config.dims:
        u = sample_sphere(config.n_vectors, dim, seed=EVAL_SEED + dim)
        grid = [(k, n) for k, n in fibquant_grid(dim, config.quick) if n <= config.max_codewords]
        fib_points = []
        for k, n in tqdm(grid, desc=f"FibQuant d={dim}", leave=False):
            if not config.build_missing:  # shipped or cached codebooks only
                try:
                    load_codebook(dim, k, n, config.seed, build=False)
                except FileNotFoundError:
                    report.skipped.append(f"d={dim} k={k} N={n}: codebook not shipped or cached "
                                          f"(fibquant codebook build --dim {dim} --k {k} --n {n})")
                    continue
            with Stopwatch() as load:
                codec = FibQuantCodec(dim, k, n, seed=config.seed)
                codebook = codec.codebook
            load_seconds = load.seconds
            build = codebook.build_seconds if math.isfinite(codebook.build_seconds) else load_seconds
            fib_points.append(Point(FIBQUANT, dim, codec.nominal_bits_per_coordinate,
                                    codec.stored_bits_per_coordinate, unit_mse(codec, u), k, n,
                                    codebook.total_mse, build))
        by_rate: dict[float, list[Point]] = {}
        for p in fib_points:
            by_rate.setdefault(round(p.bits, 6), []).append(p)
        for group in by_rate.values():
            min(group, key=lambda p: p.mse).best = True
        report.points += fib_points
        for bits in (1, 2, 3, 4):
            codec = TurboQuantCodec(dim, bits, seed=config.seed)
            report.points.append(Point(TURBOQUANT, dim, bits, codec.stored_bits_per_coordinate,
                                       unit_mse(codec, u), 1, 1 << bits))
        for bits in range(2, 9):
            codec = IntCodec(dim, bits)
            report.points.append(Point(INT, dim, bits, codec.stored_bits_per_coordinate, unit_mse(codec, u)))
        report.throughput += _throughput(dim, config)
    report.targets = check_targets(report)
    return report


def _throughput(dim: int, config: RDConfig) -> list[dict]:
    u = sample_sphere(config.throughput_vectors, dim, seed=EVAL_SEED + 1 + dim)
    rows = []
    previous_threads = torch.get_num_threads()
    if config.throughput_threads is not None and u.device.type == "cpu":
        torch.set_num_threads(config.throughput_threads)
    try:
        rows = _throughput_rows(dim, config, u)
    finally:
        torch.set_num_threads(previous_threads)
    return rows


def _throughput_rows(dim: int, config: RDConfig, u: torch.Tensor) -> list[dict]:
    rows = []
    for bits in (2, 4):
        fib = FibQuantCodec.for_rate(dim, bits, seed=config.seed)
        turbo = TurboQuantCodec(dim, bits, seed=config.seed)
        rates = measure_throughput({"fib": fib, "turbo": turbo}, u, config.throughput_repeats)
        (fib_enc, fib_dec), (tq_enc, tq_dec) = rates["fib"], rates["turbo"]
        rows.append({"dim": dim, "bits": bits, "fibquant": f"k={fib.k} N={fib.n_codewords}",
                     "fib_encode_vps": fib_enc, "fib_decode_vps": fib_dec,
                     "turbo_encode_vps": tq_enc, "turbo_decode_vps": tq_dec,
                     "encode_ratio": fib_enc / tq_enc, "decode_ratio": fib_dec / tq_dec,
                     "threads": torch.get_num_threads()})
    return rows


def check_targets(report: RDReport, dim: int = 64) -> list[dict]:
    """The targets above at `dim`, each with the measured figure and met / missed."""
    points = [p for p in report.points if p.dim == dim]
    if not points:
        return []
    out = []
    best = {round(p.bits, 6): p for p in points if p.codec == FIBQUANT and p.best}
    turbo = {p.bits: p for p in points if p.codec == TURBOQUANT}
    for bits, limit in MSE_RATIO_TARGETS.items():
        if bits in best and bits in turbo:
            ratio = best[bits].mse / turbo[bits].mse
            out.append({"target": f"FibQuant/TurboQuant MSE at b={bits:g} <= {limit}", "measured": ratio,
                        "detail": f"k={best[bits].k} N={best[bits].n_codewords}: {best[bits].mse:.5g} vs "
                                  f"{turbo[bits].mse:.5g}", "met": ratio <= limit})
    for bits, limit in SUB_ONE_BIT_TARGETS.items():
        key = round(bits, 6)
        if key in best:
            out.append({"target": f"FibQuant MSE at b={bits:g} <= {limit}", "measured": best[key].mse,
                        "detail": f"k={best[key].k} N={best[key].n_codewords}", "met": best[key].mse <= limit})
    for row in report.throughput:
        if row["dim"] != dim:
            continue
        for kind, limit in THROUGHPUT_TARGETS.items():
            ratio = row[f"{kind}_ratio"]
            out.append({"target": f"FibQuant/TurboQuant {kind} throughput at b={row['bits']} >= {limit}",
                        "measured": ratio, "detail": row["fibquant"], "met": ratio >= limit})
    return out


RD_COLUMNS = [("label", "codec", ""), ("dim", "d", "d"), ("bits", "bits", ".4g"), ("stored_bits", "stored", ".4g"),
              ("k", "k", "d"), ("n_codewords", "N", "d"), ("mse", "MSE", ".5g"), ("shannon", "4^-b", ".4g"),
              ("over_shannon", "MSE/4^-b", ".3f"), ("train_mse", "train MSE", ".5g"),
              ("build_seconds", "build s", ".1f")]


def rd_table(report) -> str:
    """The MSE table (one row per codec, dimension and rate) and the throughput lines."""
    report = _as_report(report)
    rows = []
    for p in sorted(report.points, key=lambda p: (p.dim, p.codec != FIBQUANT, p.codec, p.bits, p.k or 0)):
        shannon = 4.0 ** -p.bits
        rows.append({**asdict(p), "label": p.codec + ("*" if p.best else ""), "shannon": shannon,
                     "over_shannon": p.mse / shannon})
    lines = ["Total MSE E||u - u_hat||^2 of unit vectors (fresh samples), d = dimension",
             format_table(rows, RD_COLUMNS),
             "* = best FibQuant block size at that rate; 'stored' counts the fp16 norm / scales too"]
    lines += [f"skipped: {note}" for note in report.skipped]
    lines.append("")
    lines.append("Throughput (vectors/s incl. rotation, search and bit packing; best of repeats, "
                 "CPU threads as shown)")
    for row in report.throughput:
        lines.append(f"d={row['dim']} b={row['bits']} FibQuant({row['fibquant']}): encode {row['fib_encode_vps']:.4g} "
                     f"decode {row['fib_decode_vps']:.4g} | TurboQuant: encode {row['turbo_encode_vps']:.4g} "
                     f"decode {row['turbo_decode_vps']:.4g} | ratio encode {row['encode_ratio']:.3f} "
                     f"decode {row['decode_ratio']:.3f} (threads {row['threads']})")
    return "\n".join(lines)


def format_report(report) -> str:
    """`rd_table` followed by the targets at d = 64."""
    report = _as_report(report)
    return rd_table(report) + "\n\nTargets (d = 64)\n" + format_targets(report.targets)


def plot_report(report, path) -> None:
    """log MSE against bits per coordinate, one panel per dimension, with the Shannon bound."""
    report = _as_report(report)
    dims = sorted({p.dim for p in report.points})
    with figure(path, ncols=len(dims), figsize=(6 * len(dims), 4.5), squeeze=False) as (fig, axes):
        for ax, dim in zip(axes[0], dims):
            _plot_dim(ax, [p for p in report.points if p.dim == dim], dim)


def _plot_dim(ax, pts: list[Point], dim: int) -> None:
    rates = [x / 16 for x in range(2, 8 * 16 + 1)]
    ax.plot(rates, [4.0 ** -b for b in rates], "k--", lw=1, label="Shannon 4^-b")
    fib = [p for p in pts if p.codec == FIBQUANT]
    ax.scatter([p.bits for p in fib], [p.mse for p in fib], s=14, c="tab:blue", alpha=0.4,
               label=f"{FIBQUANT} (all k)")
    best = sorted((p for p in fib if p.best), key=lambda p: p.bits)
    ax.plot([p.bits for p in best], [p.mse for p in best], "o-", c="tab:blue", label=f"{FIBQUANT} (best k)")
    for p in best:
        ax.annotate(f"k={p.k}", (p.bits, p.mse), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for name, style, colour in ((TURBOQUANT, "s-", "tab:green"), (INT, "^-", "tab:orange")):
        sel = sorted((p for p in pts if p.codec == name), key=lambda p: p.bits)
        ax.plot([p.bits for p in sel], [p.mse for p in sel], style, c=colour, label=name)
    ax.set_yscale("log")
    ax.set_xlim(0, 8.2)
    ax.set_xlabel("index bits per coordinate")
    ax.set_ylabel("E||u - u_hat||^2 (unit vectors)")
    ax.set_title(f"d = {dim}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def run(config: RDConfig = RDConfig()) -> dict:
    """The benchmark as a JSON payload (`RDReport.to_json()`)."""
    return run_rate_distortion(config).to_json()


EXPERIMENT = Experiment(name="rate-distortion", stem="rate_distortion", config=RDConfig, run=run, table=rd_table,
                        plot=plot_report, targets=lambda payload: payload["targets"])


def write_outputs(report, out_dir=None) -> tuple:
    """Write rate_distortion.json and rate_distortion.png under out_dir (default: the results
    directory, see fibquant.paths); returns both paths."""
    paths = EXPERIMENT.report(_as_report(report).to_json(), out_dir, echo=False)
    return Path(paths["json"]), Path(paths["png"])


def quick_config(dims=(64,), seed: int = 0) -> RDConfig:
    """The quick setting: shipped codebooks only (for_rate choices), fewer vectors."""
    return RDConfig(dims=tuple(dims), n_vectors=1 << 15, quick=True, build_missing=False,
                    throughput_vectors=1 << 14, throughput_repeats=5, seed=seed)
