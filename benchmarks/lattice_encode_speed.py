"""Encode speed of the E8 ball shell code (lattice_probe.py's candidate (b')) against TurboQuant at the
same bits, one thread, plus the check that its indices decode to the nearest codebook point.

    PYTHONPATH=src .venv/bin/python benchmarks/lattice_encode_speed.py [--bits 2 3 4] [--repeats 7]

Reads the fitted radii from results/lattice_probe.json (run benchmarks/lattice_probe.py first). A
*prototype*, not a codec: numba kernel per 8-block of the rotated unit vector: sort |y| (insertion
sort, 8 values), visit the levels (shells at their radii) outward from the radius nearest ||y||
while (||y|| - r)^2 can still beat the best distance (no point of a level is nearer than that), per
level the largest inner product over its shell's leaders (8 multiply-adds per leader, the parity fix
for half-integer leaders), then the index = level offset + orbit offset + multiset-permutation rank x
signs + sign rank. The norm (fp16 bytes) and rotation are torch in float32 as in the codecs; the
index is written as 8 b bits little-endian (byte-aligned: 2 / 3 / 4 bytes per block). Not handled:
exact ties (the codec's reference rule: lowest index), which random input does not hit.

Checks before timing: numba's indices decode (unrank) to a point at the distance the search found,
and the mean of those distances equals the probe's shell-search MSE (numpy) on the same blocks.
TurboQuant runs through the registry codec on the same vectors, interleaved with ours.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lattice_probe import ShellCode, ShellTable, shell_leaders, shell_size  # noqa: E402

from fibquant.codecs.registry import parse_method  # noqa: E402
from fibquant.eval.report import format_table, write_json  # noqa: E402
from fibquant.paths import results_dir  # noqa: E402
from fibquant.source import haar_rotation, sample_sphere  # noqa: E402


def tables(shells, radii):
    """Flat arrays for the kernel: levels sorted by radius, each shell's leaders (x 2: integers)."""
    order = np.argsort(radii, kind="stable")
    shells, radii = np.asarray(shells)[order], np.asarray(radii, dtype=np.float64)[order]
    lead2, half, parity, orbit_off, mult, nsign = [], [], [], [], [], []
    lv_lo, lv_hi, lv_off, lv_scale = [], [], [], []
    offset = 0
    for m in shells:
        lv_lo.append(len(lead2))
        lv_off.append(offset)
        if m == 0:
            lv_hi.append(len(lead2))
            lv_scale.append(0.0)
            offset += 1
            continue
        li, lh, par = shell_leaders(int(m))
        inner = 0
        for leader, is_half, p in [(l, False, 0) for l in li] + [(l, True, q) for l, q in zip(lh, par)]:
            counts = np.unique(leader, return_counts=True)[1]
            perms = math.factorial(8)
            for c in counts:
                perms //= math.factorial(int(c))
            signs = 2 ** 7 if is_half else 2 ** int((leader != 0).sum())
            lead2.append(np.rint(2 * leader).astype(np.int64))
            half.append(is_half)
            parity.append(p)
            orbit_off.append(inner)
            mult.append(perms)
            nsign.append(signs)
            inner += perms * signs
        assert inner == shell_size(int(m))
        lv_hi.append(len(lead2))
        lv_scale.append(1.0 / (2.0 * math.sqrt(2.0 * m)))
        offset += inner
    as_arr = lambda v, t: np.ascontiguousarray(np.array(v, dtype=t))  # noqa: E731
    return dict(radii=radii, lv_lo=as_arr(lv_lo, np.int64), lv_hi=as_arr(lv_hi, np.int64),
                lv_off=as_arr(lv_off, np.int64), lv_scale=as_arr(lv_scale, np.float64),
                lead2=as_arr(lead2, np.int64).reshape(-1, 8), half=as_arr(half, np.bool_),
                parity=as_arr(parity, np.int64), orbit_off=as_arr(orbit_off, np.int64),
                mult=as_arr(mult, np.int64), nsign=as_arr(nsign, np.int64), count=offset)


@numba.njit(cache=False, nogil=True)
def encode_kernel(u, radii, lv_lo, lv_hi, lv_off, lv_scale, lead2, half, parity, orbit_off, mult, nsign,
                  index, dist):
    """u [n, 8] float32 blocks -> index [n] int64, dist [n] float64 (squared distance found)."""
    n = u.shape[0]
    n_lv = radii.shape[0]
    a = np.empty(8)
    p = np.empty(8, np.int64)
    y = np.empty(8)
    lead = lead2.astype(np.float64)
    w = np.empty(8, np.int64)
    cnt = np.zeros(8, np.int64)  # the rank's scratch, allocated once
    vals = np.empty(8, np.int64)
    for b in range(n):
        rho2 = 0.0
        neg = 0
        for i in range(8):
            y[i] = u[b, i]
            rho2 += y[i] * y[i]
            if y[i] < 0:
                neg += 1
        negpar = neg & 1
        rho = math.sqrt(rho2)
        for i in range(8):  # insertion sort of |y|, descending, with positions
            v = abs(y[i])
            j = i
            while j > 0 and a[j - 1] < v:
                a[j] = a[j - 1]
                p[j] = p[j - 1]
                j -= 1
            a[j] = v
            p[j] = i
        hi = np.searchsorted(radii, rho)
        lo = hi - 1
        best = np.inf
        best_lv = -1
        best_j = -1
        while True:
            dlo = (rho - radii[lo]) ** 2 if lo >= 0 else np.inf
            dhi = (rho - radii[hi]) ** 2 if hi < n_lv else np.inf
            if min(dlo, dhi) >= best:
                break
            if dlo <= dhi:
                g = lo
                lo -= 1
            else:
                g = hi
                hi += 1
            if lv_hi[g] == lv_lo[g]:
                d = rho2
                jb = -1
            else:
                top = -np.inf
                jb = -1
                for j in range(lv_lo[g], lv_hi[g]):
                    ip = 0.0
                    for k in range(8):
                        ip += a[k] * lead[j, k]
                    if half[j] and parity[j] != negpar:
                        ip -= 2.0 * a[7] * lead[j, 7]
                    if ip > top:
                        top = ip
                        jb = j
                r = radii[g]
                d = rho2 - 2.0 * r * top * lv_scale[g] + r * r
            if d < best:
                best = d
                best_lv = g
                best_j = jb
        dist[b] = best
        if best_j < 0:
            index[b] = lv_off[best_lv]
            continue
        j = best_j
        for k in range(8):
            w[p[k]] = lead2[j, k]
        # multiset-permutation rank of w (distinct values in the leader's descending order)
        rank = 0
        total = mult[j]
        for k in range(8):
            cnt[k] = 0
        nd = 0
        for k in range(8):
            if nd == 0 or vals[nd - 1] != lead2[j, k]:
                vals[nd] = lead2[j, k]
                nd += 1
            cnt[nd - 1] += 1
        for i in range(8):
            rem = 8 - i
            t = 0
            while vals[t] != w[i]:
                if cnt[t] > 0:
                    rank += total * cnt[t] // rem
                t += 1
            total = total * cnt[t] // rem
            cnt[t] -= 1
        sign = 0
        bit = 0
        if half[j]:
            flip = -1
            if parity[j] != negpar:
                flip = p[7]
            for i in range(7):
                s = 1 if y[i] < 0 else 0
                if i == flip:
                    s ^= 1
                sign |= s << i
        else:
            for i in range(8):
                if w[i] != 0:
                    if y[i] < 0:
                        sign |= 1 << bit
                    bit += 1
        index[b] = lv_off[best_lv] + orbit_off[j] + rank * nsign[j] + sign


@numba.njit(cache=False)
def decode_kernel(index, radii, lv_lo, lv_hi, lv_off, lv_scale, lead2, half, parity, orbit_off, mult, nsign,
                  out):
    """index [n] -> the unit-block points [n, 8] (the inverse of encode_kernel's numbering)."""
    n_lv = radii.shape[0]
    w = np.empty(8, np.int64)
    for b in range(index.shape[0]):
        idx = index[b]
        g = np.searchsorted(lv_off, idx, side="right") - 1
        if lv_hi[g] == lv_lo[g]:
            out[b, :] = 0.0
            continue
        rest = idx - lv_off[g]
        j = lv_lo[g]
        while j + 1 < lv_hi[g] and orbit_off[j + 1] <= rest:
            j += 1
        rest -= orbit_off[j]
        rank = rest // nsign[j]
        sign = rest % nsign[j]
        cnt = np.zeros(8, np.int64)
        vals = np.empty(8, np.int64)
        nd = 0
        for k in range(8):
            if nd == 0 or vals[nd - 1] != lead2[j, k]:
                vals[nd] = lead2[j, k]
                nd += 1
            cnt[nd - 1] += 1
        total = mult[j]
        for i in range(8):
            rem = 8 - i
            for t in range(nd):
                if cnt[t] == 0:
                    continue
                block = total * cnt[t] // rem
                if rank < block:
                    w[i] = vals[t]
                    total = block
                    cnt[t] -= 1
                    break
                rank -= block
        scale = radii[g] * lv_scale[g]
        if half[j]:
            negs = 0
            for i in range(7):
                s = (sign >> i) & 1
                negs += s
                out[b, i] = -w[i] * scale if s else w[i] * scale
            last = (parity[j] - negs) % 2
            out[b, 7] = -w[7] * scale if last else w[7] * scale
        else:
            bit = 0
            for i in range(8):
                v = w[i] * scale
                if w[i] != 0:
                    if (sign >> bit) & 1:
                        v = -v
                    bit += 1
                out[b, i] = v
    _ = n_lv


class ShellEncoder:
    """norm + rotation (torch, float32, as the codecs) + the numba shell search; bytes [n, 2 + 8 b]."""

    def __init__(self, t: dict, bits: int):
        self.t, self.bits = t, bits
        self.rotation_t = haar_rotation(64, 0).to(torch.float32).T.contiguous()
        self.args = (t["radii"], t["lv_lo"], t["lv_hi"], t["lv_off"], t["lv_scale"], t["lead2"], t["half"],
                     t["parity"], t["orbit_off"], t["mult"], t["nsign"])

    def encode(self, x: torch.Tensor) -> np.ndarray:
        norms = x.norm(dim=1)
        unit = (x / torch.where(norms > 0, norms, torch.ones_like(norms))[:, None]) @ self.rotation_t
        blocks = unit.numpy().reshape(-1, 8)
        index = np.empty(len(blocks), np.int64)
        dist = np.empty(len(blocks))
        encode_kernel(blocks, *self.args, index, dist)
        codes = np.empty((len(x), 2 + 8 * self.bits), np.uint8)
        codes[:, :2] = norms.to(torch.float16).numpy().view(np.uint8).reshape(-1, 2)
        codes[:, 2:] = index.view(np.uint8).reshape(-1, 8)[:, :self.bits].reshape(len(x), -1)
        self.last_dist, self.last_blocks = dist, blocks.astype(np.float64)
        return codes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--vectors", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--probe", default=None, help="lattice_probe.json (default: results/)")
    parser.add_argument("--kind", default="(", help="only the probe's candidates whose kind starts so, e.g. \"(c')\"")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    probe = json.loads(Path(args.probe or results_dir(None) / "lattice_probe.json").read_text())
    x = torch.randn(args.vectors, 64, generator=torch.Generator().manual_seed(31337))
    test = sample_sphere(args.vectors, 64, seed=987_654)
    rows = []
    for bits in args.bits:
        row = min((r for r in probe["rows"] if r["bits"] == bits and r["kind"] != "baseline"
                   and r["kind"].startswith(args.kind)),
                  key=lambda r: r["mse_train"])  # the probe's best shell code (of that kind) on its training vectors
        t = tables(row["shells"], row["radii"])
        enc = ShellEncoder(t, bits)
        # checks: decode(index) is at the found distance; the mean distance is the probe's (numpy) MSE
        codes = enc.encode(test)
        blocks = enc.last_blocks  # the float32 rotation's blocks, as the kernel saw them
        index = np.zeros((len(blocks), 8), np.uint8)
        index[:, :bits] = codes[:, 2:].reshape(-1, bits)
        index = index.view(np.int64).ravel()
        points = np.empty((len(blocks), 8))
        decode_kernel(index, *enc.args, points)
        err = ((points - blocks) ** 2).sum(1)
        gap = float(np.abs(err - enc.last_dist).max())
        table = ShellTable(sorted({int(m) for m in row["shells"] if m}))
        column = {m: j for j, m in enumerate(table.shells)}
        numpy_mse = ShellCode(row["shells"], row["radii"]).mse((blocks ** 2).sum(1), table.max_cos(blocks), column)
        if gap > 1e-12 or abs(8 * err.mean() - numpy_mse) > 1e-9 * numpy_mse or index.max() >= t["count"]:
            raise AssertionError(f"{bits} bits: decode gap {gap}, MSE {8 * err.mean()} vs numpy {numpy_mse}")
        turbo = parse_method(f"turboquant:b={bits}").build(64)
        turbo.encode(x[:2])
        enc.encode(x[:2])
        ours, theirs = [], []
        for _ in range(args.repeats):  # interleaved
            start = time.perf_counter()
            enc.encode(x)
            ours.append(time.perf_counter() - start)
            start = time.perf_counter()
            turbo.encode(x)
            theirs.append(time.perf_counter() - start)
        ratios = sorted(t_ / o for t_, o in zip(theirs, ours))
        rows.append({"bits": bits, "code": row["code"], "levels": len(row["shells"]),
                     "leaders": int(len(t["lead2"])), "mse": 8 * float(err.mean()), "decode_check_max_gap": gap,
                     "ours_vectors_per_s": args.vectors / statistics.median(ours),
                     "turboquant_vectors_per_s": args.vectors / statistics.median(theirs),
                     "ratio_median": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1]})
        print(rows[-1], flush=True)
    columns = [("bits", "bits", "d"), ("levels", "levels", "d"), ("leaders", "leaders", "d"),
               ("mse", "MSE", ".5f"), ("ours_vectors_per_s", "shell code vec/s", ".0f"),
               ("turboquant_vectors_per_s", "TurboQuant vec/s", ".0f"), ("ratio_median", "ratio (median)", ".2f"),
               ("ratio_min", "min", ".2f"), ("ratio_max", "max", ".2f")]
    print(format_table(rows, columns, markdown=True))
    print(f"wrote {write_json(results_dir(args.out) / 'lattice_encode_speed.json', {'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
