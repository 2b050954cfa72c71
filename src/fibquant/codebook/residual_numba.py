"""The beam search of residual codebooks compiled with numba: the codes of `residual.beam_search`.

`fast_beam_search(x, stages, beam)` returns exactly what `residual.beam_search(x, stages, beam)`
(float64 scores, the torch reference) returns, for blocks x [n, k] and stages [S, N, k]:

- per block, stage by stage, the scores ||r||^2 - 2 r . c + ||c||^2 of every kept partial sum r
  against every codeword c of the stage, in float64, the reference's expression in its order:
  (err - 2 (r . c)) + ||c||^2 with err the kept score and ||c||^2 computed by torch as the reference
  does; the dot products loop over the codewords innermost (LLVM vectorises them);
- the `beam` best (score, then (parent, codeword) order: the reference's topk order) kept in a sorted
  list of beam + 1 entries (a score at or above the list's last is skipped without work), so the
  selection costs a compare per candidate; the last stage keeps the best two;
- the dot products' summation order may differ from torch's BLAS by float64 rounding, so a block
  whose kept / dropped boundary (or, at the last stage, best and second best) lies within
  TIE_REL * (||x|| + sum_s max_c ||c_s||)^2 (a bound on the scores' magnitude) at any stage, or
  that is not finite, is flagged and recomputed by `residual.beam_search` itself: ties, exact or
  near, break as the reference breaks them. Unflagged blocks keep the same sets at every stage as
  the reference (their order inside a set only matters at exact ties, which would be flagged).

numba compiles the kernel on first use (cached on disk, `fibquant._numba.njit_cached`: once per machine).
Rows are split over threads with `fibquant._numba.run_split` when torch.get_num_threads() > 1.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from .._numba import njit_cached, numba_available, run_split
from .residual import beam_search, check_stages

TIE_REL = 1e-12
_MIN_BLOCKS_PER_THREAD = 1024
SCREEN_REL = 1e-5  # float32 screen: |float32 - float64 score| <= (2k + 8) 2^-24 * bound (k <= 32); far above
_KERNEL = None
_screen = _dots = _min = None
_LOCK = threading.Lock()
_np = None


def _beam_py(x, book_t, book32_t, sq, sq32, gram32, beam, index, flags, start, stop):
    """Beam search of blocks [start, stop) of x [n, k] (float64) over stages book_t [S, k, N] (float64,
    transposed; book32_t the same in float32), sq [S, N] = ||c||^2 (sq32 in float32), gram32 [S, S, N, N]
    (float32, [a, b, i, c] = C_a[i] . C_b[c] for a < b); writes index [n, S] (int64) and flags [n]
    (uint8: 1 = left to the reference); returns the number of flagged blocks.

    It stays one function: a numba nopython kernel; the beam (residuals, errors, index paths) and the candidate
    list are scratch arrays allocated once per call and carried from stage to stage of every block, and the
    per-codeword scoring that reads them is already in helpers (`_dots`, `_screen`, `_min`)."""
    n_st, k, n_cw = book_t.shape
    scale = 0.0
    for j in range(n_st):
        top = 0.0
        for c in range(n_cw):
            top = max(top, sq[j, c])
        scale += _np.sqrt(top)
    screen_rel = 4.0 * (2.0 * (k + 2) * (n_st + 2) + 16.0) * 2.0 ** -24
    lim = beam + 1
    resid = _np.empty((beam, k))
    new_resid = _np.empty((beam, k))
    err = _np.empty(beam)
    idx = _np.zeros((beam, n_st), dtype=_np.int64)
    new_idx = _np.zeros((beam, n_st), dtype=_np.int64)
    cand_s = _np.empty(lim)
    cand_p = _np.empty(lim, dtype=_np.int64)
    cand_c = _np.empty(lim, dtype=_np.int64)
    xc = _np.empty((n_st, n_cw), dtype=_np.float32)
    part = _np.empty(n_cw, dtype=_np.float32)
    xs = _np.empty(k, dtype=_np.float32)
    flagged = 0
    for row in range(start, stop):
        e0 = 0.0
        for d in range(k):
            e0 += x[row, d] * x[row, d]
        if not _np.isfinite(e0):
            flags[row] = 1
            flagged += 1
            continue
        bound = (_np.sqrt(e0) + scale) ** 2
        tol = TIE_REL * bound
        slack = screen_rel * bound
        for d in range(k):
            resid[0, d] = x[row, d]
            xs[d] = _np.float32(x[row, d])
        for j in range(n_st):
            _dots(book32_t[j], xs, xc[j])
        err[0] = e0
        parents = 1
        bad = False
        for j in range(n_st):
            keep = min(beam, parents * n_cw) if j < n_st - 1 else 1
            size = keep + 1
            m = 0
            for p in range(parents):
                # part[c] ~ ||c||^2 - 2 r_p . c with r_p = x - sum_{s < j} C_s[i_s]: from x . c and the Gram rows
                _screen(sq32[j], xc[j], gram32, idx[p], j, part)
                ep = err[p]
                if m == size and _min(part) > cand_s[m - 1] - ep + slack:
                    continue  # no codeword of this parent can enter the list
                for c in range(n_cw):
                    if m == size and not part[c] <= cand_s[m - 1] - ep + slack:
                        continue  # its float32 score is above the list's last by more than the screen's error
                    dot = 0.0
                    for d in range(k):
                        dot += resid[p, d] * book_t[j, d, c]
                    s = (ep - 2.0 * dot) + sq[j, c]
                    if m == size and not s < cand_s[m - 1]:
                        continue
                    # insert after every entry <= s (earlier (parent, codeword) first among equals)
                    i = m if m < size else size - 1
                    while i > 0 and cand_s[i - 1] > s:
                        if i < size:
                            cand_s[i] = cand_s[i - 1]
                            cand_p[i] = cand_p[i - 1]
                            cand_c[i] = cand_c[i - 1]
                        i -= 1
                    cand_s[i] = s
                    cand_p[i] = p
                    cand_c[i] = c
                    if m < size:
                        m += 1
            if m > keep and cand_s[keep] - cand_s[keep - 1] <= tol:
                bad = True
                break
            for i in range(keep):
                p = cand_p[i]
                c = cand_c[i]
                for d in range(k):
                    new_resid[i, d] = resid[p, d] - book_t[j, d, c]
                for s_ in range(j):
                    new_idx[i, s_] = idx[p, s_]
                new_idx[i, j] = c
                err[i] = cand_s[i]
            resid, new_resid = new_resid, resid
            idx, new_idx = new_idx, idx
            parents = keep
        if bad:
            flags[row] = 1
            flagged += 1
            continue
        for j in range(n_st):
            index[row, j] = idx[0, j]
    return flagged


def _dots_py(book32_t, xs, out):
    """out[c] = x . c in float32 over the codewords of one stage (book32_t [k, N]), vectorised over c."""
    k, n_cw = book32_t.shape
    for c in range(n_cw):
        out[c] = xs[0] * book32_t[0, c]
    for d in range(1, k):
        v = xs[d]
        for c in range(n_cw):
            out[c] += v * book32_t[d, c]


def _screen_py(sq32, xc, gram32, picks, j, part):
    """part[c] = ||c||^2 - 2 (x . c - sum_{s < j} C_s[picks[s]] . c) (float32, vectorised over c:
    unsigned indices, so that no negative-index wraparound keeps the loops from vectorising; one
    pass for j <= 2)."""
    n_cw = np.uint64(sq32.shape[0])
    if j == 0:
        for c in range(n_cw):
            part[c] = sq32[c] - np.float32(2.0) * xc[c]
        return
    g = gram32[0, j, picks[0]]
    if j == 1:
        for c in range(n_cw):
            part[c] = sq32[c] - np.float32(2.0) * (xc[c] - g[c])
        return
    h = gram32[1, j, picks[1]]
    if j == 2:
        for c in range(n_cw):
            part[c] = sq32[c] - np.float32(2.0) * ((xc[c] - g[c]) - h[c])
        return
    for c in range(n_cw):
        part[c] = (xc[c] - g[c]) - h[c]
    for s in range(2, j):
        g = gram32[s, j, picks[s]]
        for c in range(n_cw):
            part[c] -= g[c]
    for c in range(n_cw):
        part[c] = sq32[c] - np.float32(2.0) * part[c]


def _min_py(values):
    """min of finite float32 values (fastmath: vectorised; exact in any order)."""
    low = values[0]
    for c in range(values.shape[0]):
        v = values[c]
        low = v if v < low else low
    return low


def _kernel():
    global _KERNEL, _np, _screen, _dots, _min
    if _KERNEL is None:
        with _LOCK:
            if _KERNEL is None:
                _np = np
                jit = {"nogil": True, "fastmath": True}  # float32 screens: the slack covers any order
                _dots = njit_cached("void(float32[:, ::1], float32[::1], float32[::1])", **jit)(_dots_py)
                _screen = njit_cached("void(float32[::1], float32[::1], float32[:, :, :, ::1], int64[::1], int64, "
                                      "float32[::1])", **jit)(_screen_py)
                _min = njit_cached("float32(float32[::1])", **jit)(_min_py)
                signature = "int64(float64[:, ::1], float64[:, :, ::1], float32[:, :, ::1], float64[:, ::1], " \
                            "float32[:, ::1], float32[:, :, :, ::1], int64, int64[:, ::1], uint8[::1], int64, int64)"
                _KERNEL = njit_cached(signature, nogil=True)(_beam_py)
    return _KERNEL


def beam_tables(stages: torch.Tensor) -> tuple:
    """The kernel's tables of stages [S, N, k]: (float64 [S, k, N], float32 [S, k, N], ||c||^2 float64
    [S, N] (torch's, bit for bit), float32 [S, N], Gram float32 [S, S, N, N]) as numpy arrays. ~S^2 N^2 k
    operations: build once per codebook (`FibRVQCodec` caches them) and pass to
    `fast_beam_search`, whose per-call cost is then the search alone (a decode step encodes a few rows)."""
    book = stages.detach().to(device="cpu", dtype=torch.float64)
    sq = (book ** 2).sum(-1).contiguous()  # the reference's ||c||^2, bit for bit
    book_t = book.transpose(1, 2).contiguous()
    gram = torch.einsum("aik,bck->abic", book, book).to(torch.float32).contiguous()  # [S, S, N, N]
    return (book_t.numpy(), book_t.to(torch.float32).numpy(), sq.numpy(), sq.to(torch.float32).numpy(),
            gram.numpy())


def fast_beam_search(x: torch.Tensor, stages: torch.Tensor, beam: int, tables: tuple | None = None) -> torch.Tensor:
    """Blocks x [n, k] -> indices [n, S] (int64, on x's device): equal to `beam_search(x, stages, beam)`
    (float64 scores). numba on the CPU when it imports; otherwise (or for CUDA tensors) the reference.
    tables: `beam_tables(stages)` (built here when None)."""
    check_stages(x, stages)
    if isinstance(beam, bool) or not isinstance(beam, int) or beam < 1:
        raise ValueError(f"beam must be a positive integer, got {beam!r}")
    if x.device.type != "cpu" or not numba_available():
        return beam_search(x, stages, beam)
    s, n_cw, k = stages.shape
    xd = x.detach().to(torch.float64).contiguous()
    n = xd.shape[0]
    index = np.zeros((n, s), dtype=np.int64)
    flags = np.zeros(n, dtype=np.uint8)
    if n:
        if tables is None:
            tables = beam_tables(stages)
        if tables[0].shape != (s, k, n_cw):
            raise ValueError(f"tables are for stages of shape {tables[0].shape}, not {(s, k, n_cw)} transposed")
        bad = run_split(_kernel(), (xd.numpy(), *tables, beam, index, flags), n,
                        beam * n_cw * s, _MIN_BLOCKS_PER_THREAD * beam * n_cw * s, "fibquant-rvq")
        out = torch.from_numpy(index)
        if bad:
            rows = torch.from_numpy(flags.astype(bool))
            out[rows] = beam_search(x.detach()[rows], stages, beam).cpu()
        return out
    return torch.from_numpy(index)
