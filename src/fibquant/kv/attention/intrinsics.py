"""LLVM vector intrinsics of the numba kernels of `fibquant.kv.attention.numba_kernels` (numba and llvmlite
are imported only when `_build_intrinsics` runs)."""
from __future__ import annotations

import math


def _build_intrinsics():
    """The vector intrinsics: LLVM-level code keeping L query lanes in one <L x float> register.

    Field p of code row i of `rows` (2-d uint8, any row stride, bytes of a row contiguous) is
    f(p) = bits [p*bits, (p+1)*bits) of the row's bytes 2.. (little-endian), clamped to limit - 1,
    and its table entry is o(p) = p * pstride + f(p) * estride. Fields p < safe are read with one
    `word`-byte load (a literal 4, enough for bits <= 25, or 8; LLVM merges the byte loads), the
    others byte by byte, reading only the bytes that hold them (see `_safe_fields`). With a
    literal `bits`, the loop is unrolled over whole bytes so every shift is a constant.
    _lut_sum(table, rows, i, n, bits, pstride, estride, limit, safe, word, L, res, q0, nq, nu):
        s = sum_{p < n} table[o(p)*L : o(p)*L + L]   (4 interleaved vector accumulators);
        res[q0 + t, i] = nu * s[t] for t < nq
    _hist_add(table, rows, i, n, bits, pstride, estride, limit, safe, word, L, wts, q0, nq, nu):
        w[t] = wts[q0 + t, i] * nu for t < nq, 0 for nq <= t < L;
        table[o(p)*L : o(p)*L + L] += w for p < n, in order
    (res / wts: 2-d float32 arrays, any strides; nq <= L.)
    _copy4(dst, d, src, s):  dst[d*4 : d*4 + 4] = src[s*4 : s*4 + 4]
    _add4(dst, d, src, s):   dst[d*4 : d*4 + 4] += src[s*4 : s*4 + 4]
    _sum4(dst, d, a, x, b, y):  dst[d*4 : d*4 + 4] = a[x*4 : x*4 + 4] + b[y*4 : y*4 + 4]
    Tables are 1-d float32 C arrays; L (`lanes`) is a literal 4, 8 or 16. The callers
    guarantee in-range offsets (the clamp keeps f(p) < limit) and rows whose bytes are contiguous.
    Literal arguments (bits 8, strides 256 and 1, limit 256) fold into the address arithmetic. With a
    literal bits = 8 each field is the one byte at payload offset p (`safe` is then ignored: all n
    fields take the unrolled path; the caller guarantees n <= the row's payload bytes).

    One builder function, not module-level code: numba and llvmlite are optional and imported only here, when the
    kernels are first compiled; the intrinsics and the IR helpers they share are closures over those imports and
    the LLVM types, built once when the kernels compile. Each nested helper and code generator is under 80 lines.
    """
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    f32 = ir.FloatType()
    i32 = ir.IntType(32)
    i64 = ir.IntType(64)
    no_wrap = ["nuw", "nsw"]

    def const(value):
        return ir.Constant(i64, value)

    def _is_table(ty):
        return isinstance(ty, types.Array) and ty.ndim == 1 and ty.dtype == types.float32 and ty.layout == "C"

    def _literal(ty, allowed):
        return isinstance(ty, types.IntegerLiteral) and ty.literal_value in allowed

    def _typed(table, rows, scalars, word, lanes, mat, q0, nq, nu):
        return (_is_table(table) and isinstance(rows, types.Array) and rows.ndim == 2
                and rows.dtype == types.uint8 and isinstance(mat, types.Array) and mat.ndim == 2
                and mat.dtype == types.float32 and nu == types.float32
                and all(isinstance(x, types.Integer) for x in (*scalars, q0, nq))
                and _literal(word, (4, 8)) and _literal(lanes, (4, 8, 16)))

    def _lane_pointers(context, builder, signature, args, lanes):
        """(nq as i64, [float* of mat[q0 + t, i] for t < lanes]) for _lut_sum / _hist_add."""
        mat = context.make_array(signature.args[11])(context, builder, args[11])
        i_v, q0_v, nq_v = [context.cast(builder, args[x], signature.args[x], types.int64) for x in (2, 12, 13)]
        row_stride = builder.extract_value(mat.strides, 0)
        column = builder.add(builder.mul(q0_v, row_stride), builder.mul(i_v, builder.extract_value(mat.strides, 1)))
        base = builder.bitcast(mat.data, ir.IntType(8).as_pointer())
        pointers = [builder.bitcast(builder.gep(base, [builder.add(column, builder.mul(const(t), row_stride))]),
                                    f32.as_pointer()) for t in range(lanes)]
        return nq_v, pointers

    def _slot(context, builder, table_ty, table_v, offset, lanes):
        """<lanes x float>* to table[offset*lanes : (offset + 1)*lanes] (offset an i64)."""
        table = context.make_array(table_ty)(context, builder, table_v)
        at = builder.mul(offset, const(lanes), flags=no_wrap)
        return builder.bitcast(builder.gep(table.data, [at], inbounds=True), ir.VectorType(f32, lanes).as_pointer())

    def _fields(context, builder, signature, args):
        """-> (n, safe, entry, groups): entry(p, whole_word[, at, shift]) is the vector pointer of
        field p's table entry; groups(body) runs body(u, p, at, shift) over the fields p < safe in
        an unrolled loop (u = the position in the unroll); with a literal `bits` the unroll spans
        whole bytes, so each field's byte offset from the group's and its shift are constants."""
        table_ty, rows_ty = signature.args[0], signature.args[1]
        rows = context.make_array(rows_ty)(context, builder, args[1])
        i_v, n_v, bits_v, pstride_v, estride_v, limit_v, safe_v = [
            context.cast(builder, v, t, types.int64) for v, t in zip(args[2:9], signature.args[2:9])]
        word_bytes = signature.args[9].literal_value
        lanes = signature.args[10].literal_value
        row_stride = builder.extract_value(rows.strides, 0)
        payload = builder.gep(rows.data, [builder.add(builder.mul(i_v, row_stride), const(2))])
        mask = builder.sub(builder.shl(const(1), bits_v), const(1))
        top = builder.sub(limit_v, const(1))

        def byte(at):
            return builder.zext(builder.load(builder.gep(payload, [at])), i64)

        def entry(p, whole_word, at=None, shift=None):
            if at is None:
                bit = builder.mul(p, bits_v, flags=no_wrap)  # no wrap: (p*8) >> 3 folds to p
                at = builder.lshr(bit, const(3))
                shift = builder.and_(bit, const(7))
            if whole_word and literal_bits == 8:  # a field is one byte: read just it
                value = byte(at)
            elif whole_word:
                value = byte(at)
                for b in range(1, word_bytes):
                    piece = byte(builder.add(at, const(b), flags=no_wrap))
                    value = builder.or_(value, builder.shl(piece, const(8 * b)))
            else:
                n_bytes = builder.lshr(builder.add(builder.add(shift, bits_v), const(7)), const(3))
                slot = cgutils.alloca_once_value(builder, const(0))
                with cgutils.for_range(builder, n_bytes) as loop:
                    piece = builder.shl(byte(builder.add(at, loop.index)), builder.mul(loop.index, const(8)))
                    builder.store(builder.or_(builder.load(slot), piece), slot)
                value = builder.load(slot)
            field = builder.and_(builder.lshr(value, shift), mask)
            field = builder.select(builder.icmp_unsigned("<", field, limit_v), field, top)
            offset = builder.add(builder.mul(p, pstride_v, flags=no_wrap),
                                 builder.mul(field, estride_v, flags=no_wrap), flags=no_wrap)
            return _slot(context, builder, table_ty, args[0], offset, lanes)

        bits_ty = signature.args[4]
        literal_bits = bits_ty.literal_value if isinstance(bits_ty, types.IntegerLiteral) else None
        if literal_bits == 8:
            # One byte per field, inside the row's n payload bytes: every field takes the unrolled
            # path (the byte-by-byte loop of the last `word - 1` fields cost ~15-25 % of a pass).
            safe_v = n_v
        else:
            safe_v = builder.select(builder.icmp_signed("<", safe_v, n_v), safe_v, n_v)

        def groups(body):
            if literal_bits is not None:
                unroll = math.lcm(4, 8 // math.gcd(literal_bits, 8))
                group_bytes = unroll * literal_bits // 8
            else:
                unroll, group_bytes = 4, None
            count = builder.udiv(safe_v, const(unroll))
            with cgutils.for_range(builder, count) as loop:
                first = builder.mul(loop.index, const(unroll), flags=no_wrap)
                if group_bytes is not None:
                    base = builder.mul(loop.index, const(group_bytes), flags=no_wrap)
                for u in range(unroll):
                    p = builder.add(first, const(u), flags=no_wrap)
                    if group_bytes is None:
                        body(u, p, None, None)
                    else:
                        at = builder.add(base, const((u * literal_bits) >> 3), flags=no_wrap)
                        body(u, p, at, const((u * literal_bits) & 7))
            with cgutils.for_range(builder, safe_v, start=builder.mul(count, const(unroll))) as loop:
                body(0, loop.index, None, None)

        return n_v, safe_v, entry, groups, lanes

    @intrinsic
    def lut_sum(typingctx, table, rows, i, n, bits, pstride, estride, limit, safe, word, lanes, res, q0, nq, nu):
        if not _typed(table, rows, (i, n, bits, pstride, estride, limit, safe), word, lanes, res, q0, nq, nu):
            return None
        sig = types.void(table, rows, i, n, bits, pstride, estride, limit, safe, word, lanes, res, q0, nq, nu)

        def codegen(context, builder, signature, args):
            n_v, safe_v, entry, groups, width = _fields(context, builder, signature, args)
            vec = ir.VectorType(f32, width)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * width)) for _ in range(4)]

            def accumulate(acc, pointer):
                builder.store(builder.fadd(builder.load(acc), builder.load(pointer, align=4)), acc)

            groups(lambda u, p, at, shift: accumulate(accs[u % 4], entry(p, True, at, shift)))
            with cgutils.for_range(builder, n_v, start=safe_v) as loop:
                accumulate(accs[1], entry(loop.index, False))
            total = builder.fadd(builder.fadd(builder.load(accs[0]), builder.load(accs[1])),
                                 builder.fadd(builder.load(accs[2]), builder.load(accs[3])))
            nu_v = builder.insert_element(ir.Constant(vec, ir.Undefined), args[14], ir.Constant(i32, 0))
            total = builder.fmul(total, builder.shuffle_vector(nu_v, nu_v, ir.Constant(ir.VectorType(i32, width),
                                                                                          [0] * width)))
            nq_v, pointers = _lane_pointers(context, builder, signature, args, width)
            for t, pointer in enumerate(pointers):
                with builder.if_then(builder.icmp_signed(">", nq_v, const(t)), likely=True):
                    builder.store(builder.extract_element(total, ir.Constant(i32, t)), pointer)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def hist_add(typingctx, table, rows, i, n, bits, pstride, estride, limit, safe, word, lanes, wts, q0, nq, nu):
        if not _typed(table, rows, (i, n, bits, pstride, estride, limit, safe), word, lanes, wts, q0, nq, nu):
            return None
        sig = types.void(table, rows, i, n, bits, pstride, estride, limit, safe, word, lanes, wts, q0, nq, nu)

        def codegen(context, builder, signature, args):
            n_v, safe_v, entry, groups, width = _fields(context, builder, signature, args)
            vec = ir.VectorType(f32, width)
            nq_v, pointers = _lane_pointers(context, builder, signature, args, width)
            slot = cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * width))
            for t, pointer in enumerate(pointers):
                with builder.if_then(builder.icmp_signed(">", nq_v, const(t)), likely=True):
                    lane = builder.fmul(builder.load(pointer), args[14])
                    builder.store(builder.insert_element(builder.load(slot), lane, ir.Constant(i32, t)), slot)
            add = builder.load(slot)

            def scatter(pointer):
                builder.store(builder.fadd(builder.load(pointer, align=4), add), pointer, align=4)

            groups(lambda u, p, at, shift: scatter(entry(p, True, at, shift)))
            with cgutils.for_range(builder, n_v, start=safe_v) as loop:
                scatter(entry(loop.index, False))
            return context.get_dummy_value()

        return sig, codegen

    def _mover(accumulate):
        def typer(typingctx, dst, d, src, s):
            if not (_is_table(dst) and _is_table(src) and isinstance(d, types.Integer)
                    and isinstance(s, types.Integer)):
                return None
            sig = types.void(dst, d, src, s)

            def codegen(context, builder, signature, args):
                d_v, s_v = [context.cast(builder, args[x], signature.args[x], types.int64) for x in (1, 3)]
                target = _slot(context, builder, signature.args[0], args[0], d_v, 4)
                value = builder.load(_slot(context, builder, signature.args[2], args[2], s_v, 4), align=4)
                if accumulate:
                    value = builder.fadd(builder.load(target, align=4), value)
                builder.store(value, target, align=4)
                return context.get_dummy_value()

            return sig, codegen

        typer.__name__ = "add4" if accumulate else "copy4"
        return intrinsic(typer)

    @intrinsic
    def sum4(typingctx, dst, d, a, x, b, y):
        if not (_is_table(dst) and _is_table(a) and _is_table(b)
                and all(isinstance(v, types.Integer) for v in (d, x, y))):
            return None
        sig = types.void(dst, d, a, x, b, y)

        def codegen(context, builder, signature, args):
            d_v, x_v, y_v = [context.cast(builder, args[i], signature.args[i], types.int64) for i in (1, 3, 5)]
            left = builder.load(_slot(context, builder, signature.args[2], args[2], x_v, 4), align=4)
            right = builder.load(_slot(context, builder, signature.args[4], args[4], y_v, 4), align=4)
            target = _slot(context, builder, signature.args[0], args[0], d_v, 4)
            builder.store(builder.fadd(left, right), target, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return lut_sum, hist_add, _mover(False), _mover(True), sum4


_BF16 = None


def _build_bf16():
    """(as_f32, from_f32): bfloat16 read and written as its uint16 bits, so the kernels take the
    model's bf16 tensors as numpy uint16 views (numpy has no bf16) instead of float32 copies.

    as_f32(x):        x float32 -> x; x uint16 (bf16 bits) -> the float32 of those bits (exact).
    from_f32(x, out): the element of array `out` for float32 x: x itself for a float32 array; for a
                      uint16 array the bf16 bits of x rounded to nearest even, NaN -> 0x7FC0 (as
                      torch's float32 -> bfloat16 conversion, bit for bit).
    """
    global _BF16
    if _BF16 is not None:
        return _BF16
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    i16, i32 = ir.IntType(16), ir.IntType(32)

    @intrinsic
    def as_f32(typingctx, x):
        if x == types.float32:
            return types.float32(x), lambda context, builder, signature, args: args[0]
        if x != types.uint16:
            return None

        def codegen(context, builder, signature, args):
            wide = builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16))
            return builder.bitcast(wide, ir.FloatType())

        return types.float32(x), codegen

    @intrinsic
    def from_f32(typingctx, x, out):
        if x != types.float32 or not isinstance(out, types.Array):
            return None
        if out.dtype == types.float32:
            return types.float32(x, out), lambda context, builder, signature, args: args[0]
        if out.dtype != types.uint16:
            return None

        def codegen(context, builder, signature, args):
            bits = builder.bitcast(args[0], i32)
            lsb = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
            rounded = builder.add(bits, builder.add(lsb, ir.Constant(i32, 0x7FFF)))
            value = builder.trunc(builder.lshr(rounded, ir.Constant(i32, 16)), i16)
            nan = builder.fcmp_unordered("uno", args[0], args[0])
            return builder.select(nan, ir.Constant(i16, 0x7FC0), value)

        return types.uint16(x, out), codegen

    _BF16 = as_f32, from_f32
    return _BF16


_GATHERS = None


def _build_gathers():
    """(gather_scores, gather_values): decode-then-dot over code rows of 8-bit indices into a codebook
    of 2-float codewords (FibQuant at 4 bits: k = 2, N = 256), the codewords fetched 8 at a time with
    one vector gather (`llvm.masked.gather`: vpgatherqq on AVX2 / AVX-512; scalarised by LLVM
    elsewhere) and multiplied with the G query rows (or weights) in <16 x float> registers.

    Why: the table path (`lut_sum` / `hist_add`) makes a [codeword, block, lane] table (keys) and
    histogram (values) of 128 KB per unit at 4 bits, beyond L1, and the histogram still needs its
    contraction with the codewords; here the working set is the 2 KB codebook and G accumulators.

    Row i's decoded vector is x_i[2 j : 2 j + 2] = codewords[rows[i, 2 + j]] for j < 8 * vecs
    (D = 16 * vecs floats; bytes 0-1 of a row, the norm, are not read). `vecs` (4 or 8: D = 64 or 128)
    and `heads` (G, 1..4) are literals; codewords a float32 C array [256, 2] (every byte a valid index),
    rows 2-d uint8 with any row stride, norms 1-d float32, query / acc float32 C arrays, res / wts
    float32 2-d with any strides.
    gather_scores(codewords, rows, n, vecs, heads, query, q0, norms, res):
        res[t, i] = norms[i] * (query[q0 + t, :D] . x_i)                      for t < G, i < n
    gather_values(codewords, rows, n, vecs, heads, wts, norms, acc, a0):
        acc[a0 + t, :D] += sum_{i < n} (wts[t, i] * norms[i]) * x_i           for t < G (i ascending)
    The score's dot product is summed as a tree (reassociated); the value sums keep token order per
    coordinate (one fused multiply-add per token).

    One builder function, not module-level code: numba and llvmlite are optional and imported only here, when the
    kernels are first compiled; the intrinsics and the IR helpers they share are closures over those imports and
    the LLVM types, built once when the kernels compile. Each nested helper and code generator is under 80 lines.
    """
    global _GATHERS
    if _GATHERS is not None:
        return _GATHERS
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    f32, i8, i32, i64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
    width = 8  # codewords (8 bytes each) per gather: one <16 x float>
    vec = ir.VectorType(f32, 16)
    vec_i64 = ir.VectorType(i64, width)

    def const(value):
        return ir.Constant(i64, value)

    def _literal(ty, allowed):
        return isinstance(ty, types.IntegerLiteral) and ty.literal_value in allowed

    def _f32_array(ty, ndim, contiguous=False):
        return (isinstance(ty, types.Array) and ty.ndim == ndim and ty.dtype == types.float32
                and (not contiguous or ty.layout == "C"))

    def _typed(codewords, rows, n, vecs, heads, norms):
        return (_f32_array(codewords, 2, True) and isinstance(rows, types.Array) and rows.ndim == 2
                and rows.dtype == types.uint8 and isinstance(n, types.Integer) and _literal(vecs, (4, 8))
                and _literal(heads, (1, 2, 3, 4)) and _f32_array(norms, 1))

    def _address(builder, array, *indices):
        """float* to array[indices] (byte strides: any layout)."""
        at = builder.ptrtoint(array.data, i64)
        for k, index in enumerate(indices):
            at = builder.add(at, builder.mul(index, builder.extract_value(array.strides, k)))
        return builder.inttoptr(at, f32.as_pointer())

    def _splat(builder, x):
        one = builder.insert_element(ir.Constant(vec, ir.Undefined), x, ir.Constant(i32, 0))
        return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(i32, 16), [0] * 16))

    def _decoder(context, builder, signature, args):
        """-> (n as i64, rows(i) -> [<16 x float>] * vecs, norm(i) -> float)."""
        codewords = context.make_array(signature.args[0])(context, builder, args[0])
        rows = context.make_array(signature.args[1])(context, builder, args[1])
        n_v = context.cast(builder, args[2], signature.args[2], types.int64)
        vecs = signature.args[3].literal_value
        norms = context.make_array(signature.args[7])(context, builder, args[7])
        base = builder.ptrtoint(codewords.data, i64)
        base = builder.insert_element(ir.Constant(vec_i64, ir.Undefined), base, ir.Constant(i32, 0))
        base = builder.shuffle_vector(base, base, ir.Constant(ir.VectorType(i32, width), [0] * width))
        row_stride = builder.extract_value(rows.strides, 0)
        mask = ir.Constant(ir.VectorType(ir.IntType(1), width), [1] * width)
        pointers = ir.VectorType(i64.as_pointer(), width)
        gather_type = ir.FunctionType(vec_i64, [pointers, i32, mask.type, vec_i64])
        gather = cgutils.get_or_insert_function(builder.module, gather_type, "llvm.masked.gather.v8i64.v8p0")

        def decode(i):
            payload = builder.gep(rows.data, [builder.add(builder.mul(i, row_stride), const(2))])
            out = []
            for g in range(vecs):
                at = builder.bitcast(builder.gep(payload, [const(width * g)]), ir.VectorType(i8, width).as_pointer())
                index = builder.zext(builder.load(at, align=1), vec_i64)
                offsets = builder.shl(index, ir.Constant(vec_i64, [3] * width))  # 8 bytes per codeword
                words = builder.call(gather, [builder.inttoptr(builder.add(base, offsets), pointers),
                                              ir.Constant(i32, 4), mask, ir.Constant(vec_i64, ir.Undefined)])
                out.append(builder.bitcast(words, vec))
            return out

        def norm(i):
            return builder.load(_address(builder, norms, i))

        return n_v, decode, norm

    @intrinsic
    def gather_scores(typingctx, codewords, rows, n, vecs, heads, query, q0, norms, res):
        if not (_typed(codewords, rows, n, vecs, heads, norms) and _f32_array(query, 2, True)
                and isinstance(q0, types.Integer) and _f32_array(res, 2)):
            return None
        sig = types.void(codewords, rows, n, vecs, heads, query, q0, norms, res)

        def codegen(context, builder, signature, args):
            # args order differs from _decoder's (norms at 7 in both signatures)
            n_v, decode, norm = _decoder(context, builder, signature, args)
            vecs_n, groups = signature.args[3].literal_value, signature.args[4].literal_value
            query_a = context.make_array(signature.args[5])(context, builder, args[5])
            res_a = context.make_array(signature.args[8])(context, builder, args[8])
            q0_v = context.cast(builder, args[6], signature.args[6], types.int64)
            q_rows = [builder.bitcast(_address(builder, query_a, builder.add(q0_v, const(t)), const(0)),
                                      vec.as_pointer()) for t in range(groups)]
            q_vecs = [[builder.load(builder.gep(q_rows[t], [const(g)]), align=4) for g in range(vecs_n)]
                      for t in range(groups)]
            reduce_type = ir.FunctionType(f32, [f32, vec])
            reduce = cgutils.get_or_insert_function(builder.module, reduce_type, "llvm.vector.reduce.fadd.v16f32")
            with cgutils.for_range(builder, n_v) as loop:
                i = loop.index
                x = decode(i)
                nu = norm(i)
                for t in range(groups):
                    s = builder.fmul(q_vecs[t][0], x[0], flags=["fast"])
                    for g in range(1, vecs_n):
                        s = builder.fadd(builder.fmul(q_vecs[t][g], x[g], flags=["fast"]), s, flags=["fast"])
                    total = builder.call(reduce, [ir.Constant(f32, 0.0), s], fastmath=("fast",))
                    builder.store(builder.fmul(total, nu), _address(builder, res_a, const(t), i))
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def gather_values(typingctx, codewords, rows, n, vecs, heads, wts, norms_, acc, a0):
        # norms_ sits at position 6 here; _decoder reads position 7, so it is given a reordered view
        if not (_typed(codewords, rows, n, vecs, heads, norms_) and _f32_array(wts, 2) and _f32_array(acc, 2, True)
                and isinstance(a0, types.Integer)):
            return None
        sig = types.void(codewords, rows, n, vecs, heads, wts, norms_, acc, a0)

        def codegen(context, builder, signature, args):
            order = (0, 1, 2, 3, 4, 5, 8, 6)  # put norms at index 7 for _decoder
            view = types.void(*[signature.args[k] for k in order])
            n_v, decode, norm = _decoder(context, builder, view, [args[k] for k in order])
            vecs_n, groups = signature.args[3].literal_value, signature.args[4].literal_value
            wts_a = context.make_array(signature.args[5])(context, builder, args[5])
            acc_a = context.make_array(signature.args[7])(context, builder, args[7])
            a0_v = context.cast(builder, args[8], signature.args[8], types.int64)
            acc_rows = [builder.bitcast(_address(builder, acc_a, builder.add(a0_v, const(t)), const(0)),
                                        vec.as_pointer()) for t in range(groups)]
            slots = [[cgutils.alloca_once_value(builder, builder.load(builder.gep(acc_rows[t], [const(g)]), align=4))
                      for g in range(vecs_n)] for t in range(groups)]
            with cgutils.for_range(builder, n_v) as loop:
                i = loop.index
                x = decode(i)
                nu = norm(i)
                for t in range(groups):
                    w = _splat(builder, builder.fmul(builder.load(_address(builder, wts_a, const(t), i)), nu))
                    for g in range(vecs_n):
                        slot = slots[t][g]
                        product = builder.fmul(w, x[g], flags=["contract"])
                        builder.store(builder.fadd(builder.load(slot), product, flags=["contract"]), slot)
            for t in range(groups):
                for g in range(vecs_n):
                    builder.store(builder.load(slots[t][g]), builder.gep(acc_rows[t], [const(g)]), align=4)
            return context.get_dummy_value()

        return sig, codegen

    _GATHERS = gather_scores, gather_values
    return _GATHERS


_PERMUTES = None


def _target_features() -> set:
    """The CPU features numba compiles for (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES when set, else the host's)."""
    from numba.core import config

    if config.CPU_NAME:
        text = config.CPU_FEATURES or ""
    else:
        from numba.core.codegen import get_host_cpu_features
        text = get_host_cpu_features()
    return {part[1:] for part in text.split(",") if part.startswith("+")}


def _build_permutes(features=None):
    """(perm_scores, perm_values): decode-then-dot over code rows of 4-bit indices (two per byte, the
    low nibble first) into a codebook of 16 scalars (k = 1, N = 16: FibQuant `k=1,n=16`, TurboQuant
    at 4 bits), decoded in registers: the 16 codewords fill one <16 x float> and 16 indices decode with
    one variable permute (`vpermps zmm` on AVX-512; on AVX2 two `vpermps ymm` and a blend on index
    bit 3; elsewhere a gather from the codebook, which LLVM scalarises).

    Why: the byte table / histogram path reads 32 x 256 x 4-float tables per unit (128 KB, beyond
    L1), the k = 2 gathers pay ~10 cycles per 8 codewords; here a 64-d row is two 16-byte loads, a few
    shifts / ands and four permutes, then plain FMAs with the query (or weights) in registers.

    Payload byte m of 16-byte chunk c (row bytes 2 + 16 c + m; bytes 0-1, the norm, are not read) holds
    coordinates 32 c + 2 m (low nibble) and 32 c + 2 m + 1 (high nibble), so a chunk decodes into an even
    and an odd <16 x float>; the query rows (keys) and accumulators (values) are de-interleaved into that
    order once per call by constant shuffles. Row i's norm nu_i is its fp16 bytes 0-1, converted here
    (16 rows at a time, integer ops: `_half`), so the caller needs no norm pass. `vecs` (4 or 8:
    D = 16 * vecs) and `heads` (G, 1..4) are literals; codewords a float32 C array [16, 1], rows 2-d
    uint8 with any row stride, query / acc float32 C arrays, res / wts float32 2-d with any strides:
    perm_scores(codewords, rows, n, vecs, heads, query, q0, res):
        res[t, i] = nu_i * (query[q0 + t, :D] . x_i)                          for t < G, i < n
    perm_values(codewords, rows, n, vecs, heads, wts, acc, a0):
        acc[a0 + t, :D] += sum_{i < n} (wts[t, i] * nu_i) * x_i               for t < G (i ascending)
    Scores: 16 tokens' dot products are reduced together by a shuffle tree (one <16 x float> of 16
    sums), the rest one by one; both reassociate the sums (float rounding). Values: one fused
    multiply-add per token and coordinate, token order kept.
    `features` (a set of CPU feature names; default: numba's target) picks the permute.

    One builder function, not module-level code: numba and llvmlite are optional and imported only here, when the
    kernels are first compiled; the intrinsics and the IR helpers they share are closures over those imports and
    the LLVM types, built once when the kernels compile. Each nested helper and code generator is under 80 lines.
    """
    global _PERMUTES
    if _PERMUTES is not None and features is None:
        return _PERMUTES
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    chosen = _target_features() if features is None else set(features)
    isa = "avx512" if "avx512f" in chosen else "avx2" if "avx2" in chosen else "generic"
    f32, i8, i32, i64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
    vec, vec_i32, vec_i8 = ir.VectorType(f32, 16), ir.VectorType(i32, 16), ir.VectorType(i8, 16)
    vec8, vec8_i32 = ir.VectorType(f32, 8), ir.VectorType(i32, 8)

    def const(value):
        return ir.Constant(i64, value)

    def mask(lanes):
        return ir.Constant(ir.VectorType(i32, len(lanes)), list(lanes))

    even, odd = mask(range(0, 32, 2)), mask(range(1, 32, 2))  # de-interleave two <16 x float>
    low = mask([m // 2 + (16 if m % 2 else 0) for m in range(16)])  # re-interleave (even, odd) -> 32 coordinates
    high = mask([8 + m // 2 + (16 if m % 2 else 0) for m in range(16)])

    def _literal(ty, allowed):
        return isinstance(ty, types.IntegerLiteral) and ty.literal_value in allowed

    def _f32_array(ty, ndim, contiguous=False):
        return (isinstance(ty, types.Array) and ty.ndim == ndim and ty.dtype == types.float32
                and (not contiguous or ty.layout == "C"))

    def _typed(codewords, rows, n, vecs, heads):
        return (_f32_array(codewords, 2, True) and isinstance(rows, types.Array) and rows.ndim == 2
                and rows.dtype == types.uint8 and isinstance(n, types.Integer) and _literal(vecs, (4, 8))
                and _literal(heads, (1, 2, 3, 4)))

    def _address(builder, array, *indices):
        """float* to array[indices] (byte strides: any layout)."""
        at = builder.ptrtoint(array.data, i64)
        for k, index in enumerate(indices):
            at = builder.add(at, builder.mul(index, builder.extract_value(array.strides, k)))
        return builder.inttoptr(at, f32.as_pointer())

    def _splat(builder, x):
        one = builder.insert_element(ir.Constant(vec, ir.Undefined), x, ir.Constant(i32, 0))
        return builder.shuffle_vector(one, one, mask([0] * 16))

    def _half(builder, h, width=None):
        """fp16 bits h (i32, or <width x i32>) -> float32, exactly (normals, subnormals, zeros, inf; NaN
        stays NaN) with integer ops only, as `numba_decode._norms` (no F16C / libcall needed)."""
        ty = h.type

        def c(value):
            return ir.Constant(ty, value if width is None else [value] * width)

        fty = f32 if width is None else ir.VectorType(f32, width)
        em = builder.and_(h, c(0x7FFF))
        sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
        shift = builder.select(builder.icmp_unsigned(">=", em, c(0x7C00)), c(224 << 23), c(112 << 23))
        normal = builder.bitcast(builder.or_(builder.add(builder.shl(em, c(13)), shift), sign), fty)
        tiny = builder.fmul(builder.uitofp(em, fty), ir.Constant(fty, 2.0 ** -24 if width is None else [2.0 ** -24] * width))
        tiny = builder.bitcast(builder.or_(builder.bitcast(tiny, ty), sign), fty)  # sign bit: exact negation
        return builder.select(builder.icmp_unsigned("<", em, c(0x400)), tiny, normal)

    def _load16(builder, array, row, first, contiguous):
        """<16 x float> of array[row, first : first + 16] (2-d float32, any strides): one load when the
        columns are contiguous (`contiguous`: an i1), else 16."""
        slot = cgutils.alloca_once(builder, vec)
        with builder.if_else(contiguous, likely=True) as (whole, lanes):
            with whole:
                builder.store(builder.load(builder.bitcast(_address(builder, array, row, first), vec.as_pointer()),
                                           align=4), slot)
            with lanes:
                value = ir.Constant(vec, ir.Undefined)
                for lane in range(16):
                    x = builder.load(_address(builder, array, row, builder.add(first, const(lane))))
                    value = builder.insert_element(value, x, ir.Constant(i32, lane))
                builder.store(value, slot)
        return builder.load(slot)

    def _permuter(builder, book, book_pointer):
        """index <16 x i32> (each < 16) -> <16 x float> of book[index]."""
        if isa == "avx512":
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, vec_i32]),
                                                "llvm.x86.avx512.permvar.sf.512")
            return lambda index: builder.call(fn, [book, index])
        if isa == "avx2":
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec8, [vec8, vec8_i32]),
                                                "llvm.x86.avx2.permps")
            halves = [builder.shuffle_vector(book, book, mask(range(8 * h, 8 * h + 8))) for h in (0, 1)]

            def permute(index):
                parts = []
                for h in (0, 1):
                    part = builder.shuffle_vector(index, index, mask(range(8 * h, 8 * h + 8)))
                    upper = builder.icmp_unsigned("!=", builder.and_(part, ir.Constant(vec8_i32, [8] * 8)),
                                                  ir.Constant(vec8_i32, [0] * 8))
                    parts.append(builder.select(upper, builder.call(fn, [halves[1], part]),
                                                builder.call(fn, [halves[0], part])))
                return builder.shuffle_vector(parts[0], parts[1], mask(range(16)))

            return permute
        pointers = ir.VectorType(f32.as_pointer(), 16)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vec, [pointers, i32, ir.VectorType(ir.IntType(1), 16), vec]),
            "llvm.masked.gather.v16f32.v16p0")
        base = builder.ptrtoint(book_pointer, i64)
        base = builder.insert_element(ir.Constant(ir.VectorType(i64, 16), ir.Undefined), base, ir.Constant(i32, 0))
        base = builder.shuffle_vector(base, base, mask([0] * 16))
        everywhere = ir.Constant(ir.VectorType(ir.IntType(1), 16), [1] * 16)

        def gather(index):
            offsets = builder.shl(builder.zext(index, ir.VectorType(i64, 16)), ir.Constant(ir.VectorType(i64, 16),
                                                                                         [2] * 16))
            return builder.call(fn, [builder.inttoptr(builder.add(base, offsets), pointers), ir.Constant(i32, 4),
                                     everywhere, ir.Constant(vec, ir.Undefined)])

        return gather

    def _decoder(context, builder, codewords_ty, codewords_v, rows_ty, rows_v, vecs):
        """-> (decode(i) -> [<16 x float>] * vecs in (even, odd) order per chunk, half(i) -> the i32 of
        row i's fp16 norm bits (bytes 0-1, little-endian): `_half` makes it a float)."""
        codewords = context.make_array(codewords_ty)(context, builder, codewords_v)
        rows = context.make_array(rows_ty)(context, builder, rows_v)
        book = builder.load(builder.bitcast(codewords.data, vec.as_pointer()), align=4)
        permute = _permuter(builder, book, codewords.data)
        row_stride = builder.extract_value(rows.strides, 0)
        nibble = ir.Constant(vec_i32, [15] * 16)
        four = ir.Constant(vec_i32, [4] * 16)

        def decode(i):
            payload = builder.gep(rows.data, [builder.add(builder.mul(i, row_stride), const(2))])
            out = []
            for c in range(vecs // 2):
                at = builder.bitcast(builder.gep(payload, [const(16 * c)]), vec_i8.as_pointer())
                index = builder.zext(builder.load(at, align=1), vec_i32)
                out.append(permute(builder.and_(index, nibble)))
                out.append(permute(builder.lshr(index, four)))
            return out

        def half(i):
            at = builder.bitcast(builder.gep(rows.data, [builder.mul(i, row_stride)]), ir.IntType(16).as_pointer())
            return builder.zext(builder.load(at, align=1), i32)

        return decode, half

    def _split(builder, pointer, vecs):
        """the <16 x float>s at pointer[0 : 16 * vecs], de-interleaved into (even, odd) per 32 floats."""
        loaded = [builder.load(builder.gep(pointer, [const(g)]), align=4) for g in range(vecs)]
        out = []
        for c in range(vecs // 2):
            a, b = loaded[2 * c], loaded[2 * c + 1]
            out += [builder.shuffle_vector(a, b, even), builder.shuffle_vector(a, b, odd)]
        return out

    def _fold(builder, a, b, h):
        """One level of the reduction tree: per block of 2h lanes, lanes [0, h) = a's block folded in
        half, [h, 2h) = b's. Four levels (h = 8, 4, 2, 1) over inputs p = 0..15 leave lane l holding
        the sum of input bitrev(l) (4 bits): the callers feed token bitrev(p) as input p."""
        x = mask([(lane // (2 * h)) * 2 * h + lane % (2 * h) % h + (16 if lane % (2 * h) >= h else 0)
                  for lane in range(16)])
        y = mask([(lane // (2 * h)) * 2 * h + lane % (2 * h) % h + h + (16 if lane % (2 * h) >= h else 0)
                  for lane in range(16)])
        return builder.fadd(builder.shuffle_vector(a, b, x), builder.shuffle_vector(a, b, y), flags=["fast"])

    def _dot(builder, q, x):
        s = builder.fmul(q[0], x[0], flags=["fast"])
        for g in range(1, len(x)):
            s = builder.fadd(builder.fmul(q[g], x[g], flags=["fast"]), s, flags=["fast"])
        return s

    @intrinsic
    def perm_scores(typingctx, codewords, rows, n, vecs, heads, query, q0, res):
        if not (_typed(codewords, rows, n, vecs, heads) and _f32_array(query, 2, True)
                and isinstance(q0, types.Integer) and _f32_array(res, 2)):
            return None
        sig = types.void(codewords, rows, n, vecs, heads, query, q0, res)

        def codegen(context, builder, signature, args):
            a = signature.args
            vecs_n, groups = a[3].literal_value, a[4].literal_value
            decode, half = _decoder(context, builder, a[0], args[0], a[1], args[1], vecs_n)
            n_v = context.cast(builder, args[2], a[2], types.int64)
            query_a = context.make_array(a[5])(context, builder, args[5])
            res_a = context.make_array(a[7])(context, builder, args[7])
            q0_v = context.cast(builder, args[6], a[6], types.int64)
            q_vecs = [_split(builder, builder.bitcast(_address(builder, query_a, builder.add(q0_v, const(t)), const(0)),
                                                      vec.as_pointer()), vecs_n) for t in range(groups)]
            res_step = builder.extract_value(res_a.strides, 1)
            contiguous = builder.icmp_signed("==", res_step, const(4))
            reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, vec]),
                                                    "llvm.vector.reduce.fadd.v16f32")
            bitrev = [int(f"{p:04b}"[::-1], 2) for p in range(16)]
            with cgutils.for_range(builder, builder.udiv(n_v, const(16))) as loop:  # 16 tokens at a time
                i0 = builder.mul(loop.index, const(16), flags=["nuw", "nsw"])
                stacks = [[] for _ in range(groups)]  # (level, vector): a binary counter of folded pairs
                nu = ir.Constant(vec_i32, ir.Undefined)
                for p in range(16):
                    i = builder.add(i0, const(bitrev[p]))
                    x = decode(i)
                    nu = builder.insert_element(nu, half(i), ir.Constant(i32, bitrev[p]))
                    for t in range(groups):
                        stack = stacks[t]
                        stack.append((0, _dot(builder, q_vecs[t], x)))
                        while len(stack) > 1 and stack[-1][0] == stack[-2][0]:
                            (level, right), (_, left) = stack.pop(), stack.pop()
                            stack.append((level + 1, _fold(builder, left, right, 8 >> level)))
                nu = _half(builder, nu, 16)
                for t in range(groups):
                    total = builder.fmul(stacks[t][0][1], nu)
                    first = _address(builder, res_a, const(t), i0)
                    with builder.if_else(contiguous, likely=True) as (whole, lanes):
                        with whole:
                            builder.store(total, builder.bitcast(first, vec.as_pointer()), align=4)
                        with lanes:
                            for lane in range(16):
                                builder.store(builder.extract_element(total, ir.Constant(i32, lane)),
                                              _address(builder, res_a, const(t), builder.add(i0, const(lane))))
            with cgutils.for_range(builder, n_v, start=builder.mul(builder.udiv(n_v, const(16)), const(16))) as loop:
                i = loop.index
                x = decode(i)
                nu = _half(builder, half(i))
                for t in range(groups):
                    total = builder.call(reduce, [ir.Constant(f32, 0.0), _dot(builder, q_vecs[t], x)],
                                         fastmath=("fast",))
                    builder.store(builder.fmul(total, nu), _address(builder, res_a, const(t), i))
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def perm_values(typingctx, codewords, rows, n, vecs, heads, wts, acc, a0):
        if not (_typed(codewords, rows, n, vecs, heads) and _f32_array(wts, 2) and _f32_array(acc, 2, True)
                and isinstance(a0, types.Integer)):
            return None
        sig = types.void(codewords, rows, n, vecs, heads, wts, acc, a0)

        def codegen(context, builder, signature, args):
            a = signature.args
            vecs_n, groups = a[3].literal_value, a[4].literal_value
            decode, half = _decoder(context, builder, a[0], args[0], a[1], args[1], vecs_n)
            n_v = context.cast(builder, args[2], a[2], types.int64)
            wts_a = context.make_array(a[5])(context, builder, args[5])
            acc_a = context.make_array(a[6])(context, builder, args[6])
            a0_v = context.cast(builder, args[7], a[7], types.int64)
            acc_rows = [builder.bitcast(_address(builder, acc_a, builder.add(a0_v, const(t)), const(0)),
                                        vec.as_pointer()) for t in range(groups)]
            slots = [[cgutils.alloca_once_value(builder, v) for v in _split(builder, acc_rows[t], vecs_n)]
                     for t in range(groups)]
            contiguous = builder.icmp_signed("==", builder.extract_value(wts_a.strides, 1), const(4))

            def add(x, w):
                for t in range(groups):
                    for g in range(vecs_n):
                        slot = slots[t][g]
                        product = builder.fmul(w[t], x[g], flags=["contract"])
                        builder.store(builder.fadd(builder.load(slot), product, flags=["contract"]), slot)

            whole = builder.udiv(n_v, const(16))
            with cgutils.for_range(builder, whole) as loop:  # 16 tokens at a time: norms and weights as vectors
                i0 = builder.mul(loop.index, const(16), flags=["nuw", "nsw"])
                nu = ir.Constant(vec_i32, ir.Undefined)
                for p in range(16):
                    nu = builder.insert_element(nu, half(builder.add(i0, const(p))), ir.Constant(i32, p))
                nu = _half(builder, nu, 16)
                w16 = [builder.fmul(_load16(builder, wts_a, const(t), i0, contiguous), nu) for t in range(groups)]
                for p in range(16):
                    add(decode(builder.add(i0, const(p))), [builder.shuffle_vector(w, w, mask([p] * 16)) for w in w16])
            with cgutils.for_range(builder, n_v, start=builder.mul(whole, const(16))) as loop:
                i = loop.index
                nu = _half(builder, half(i))
                add(decode(i), [_splat(builder, builder.fmul(builder.load(_address(builder, wts_a, const(t), i)), nu))
                                for t in range(groups)])
            for t in range(groups):
                for c in range(vecs_n // 2):
                    e, o = builder.load(slots[t][2 * c]), builder.load(slots[t][2 * c + 1])
                    builder.store(builder.shuffle_vector(e, o, low), builder.gep(acc_rows[t], [const(2 * c)]), align=4)
                    builder.store(builder.shuffle_vector(e, o, high), builder.gep(acc_rows[t], [const(2 * c + 1)]),
                                  align=4)
            return context.get_dummy_value()

        return sig, codegen

    result = perm_scores, perm_values
    if features is None:
        _PERMUTES = result
    return result


_HALVES = None


def _build_halves():
    """(halves_scores, halves_hist, halves_build, halves_contract): one code row's blocks through the
    per-query tables over the 4-d halves of E8 shell points (`codebook.e8shell_tables.CompactPointTables`, the b <= 2
    step of `numba_shells`), 4 query lanes in one <4 x float> register per table entry (numba's scalar code read
    and multiplied the 4 lanes one by one), and the tables' build / contraction the same way.

    Block j's step word w = wr[j] (int64 holding a `numba_shells.step_words` word): bits 0..10 / 11..21 the two
    halves lo / hi, bits 22..30 (the halves' signs and the level) the index of the pair (s_lo, s_hi) in `pairs`
    (the level's scale with each half's sign: two broadcast loads, no arithmetic), bit 31 an index beyond the
    code's points (counted; its fields are index 0's).
    table: float32 C [Q, H, 4] (Q >= 2 * len(wr)); wr: int64 1-d C; pairs float32 1-d C [1024]; res / w4:
    float32 1-d C of >= 4 entries. Both return sum_j (w_j >> 31) (the bad indices).
    halves_scores(table, wr, pairs, res):
        res[:4] = sum_j s_lo table[2 j, lo] + s_hi table[2 j + 1, hi]        (two accumulators, fused)
    halves_hist(table, wr, pairs, w4):
        table[2 j, lo] += s_lo w4;  table[2 j + 1, hi] += s_hi w4           for j ascending
    halves_build(table, halves, rq44) / halves_contract(table, halves, out44): the tables' build and the
    histogram's contraction (below). The callers guarantee in-range offsets (the words come from the tables
    the table was built over).

    One builder function, not module-level code: numba and llvmlite are optional and imported only here, when the
    kernels are first compiled; the intrinsics and the IR helpers they share are closures over those imports and
    the LLVM types, built once when the kernels compile. Each nested helper and code generator is under 80 lines.
    """
    global _HALVES
    if _HALVES is not None:
        return _HALVES
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    vec = ir.VectorType(f32, 4)
    no_wrap = ["nuw", "nsw"]

    def const(value, ty=i64):
        return ir.Constant(ty, value)

    def _c_array(ty, ndim, dtype):
        return isinstance(ty, types.Array) and ty.ndim == ndim and ty.dtype == dtype and ty.layout == "C"

    def _typed(table, wr, pairs, out):
        return (_c_array(table, 3, types.float32) and _c_array(wr, 1, types.int64)
                and _c_array(pairs, 1, types.float32) and _c_array(out, 1, types.float32))

    def _splat(builder, x):
        one = builder.insert_element(ir.Constant(vec, ir.Undefined), x, const(0, i32))
        return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(i32, 4), [0] * 4))

    def _blocks(context, builder, signature, args, body):
        """Runs body(lo_pointer, s_lo, hi_pointer, s_hi) per block; returns the bad count (i64)."""
        table = context.make_array(signature.args[0])(context, builder, args[0])
        wr = context.make_array(signature.args[1])(context, builder, args[1])
        pairs = context.make_array(signature.args[2])(context, builder, args[2])
        n_half = cgutils.unpack_tuple(builder, table.shape)[1]
        n_blk = cgutils.unpack_tuple(builder, wr.shape)[0]
        row = builder.mul(n_half, const(16), flags=no_wrap)  # bytes per table row q
        data = builder.bitcast(table.data, ir.IntType(8).as_pointer())
        bad = cgutils.alloca_once_value(builder, const(0))
        with cgutils.for_range(builder, n_blk) as loop:
            j = loop.index
            w = builder.load(builder.gep(wr.data, [j], inbounds=True))
            builder.store(builder.add(builder.load(bad), builder.lshr(w, const(31))), bad)
            pair = builder.mul(builder.and_(builder.lshr(w, const(22)), const(511)), const(2), flags=no_wrap)
            s_lo = builder.load(builder.gep(pairs.data, [pair], inbounds=True))
            s_hi = builder.load(builder.gep(pairs.data, [builder.add(pair, const(1), flags=no_wrap)], inbounds=True))
            lo = builder.and_(builder.shl(w, const(4)), const(2047 << 4))
            hi = builder.and_(builder.lshr(w, const(7)), const(2047 << 4))
            base = builder.mul(builder.mul(j, const(2), flags=no_wrap), row, flags=no_wrap)
            at_lo = builder.add(base, lo, flags=no_wrap)
            at_hi = builder.add(builder.add(base, row, flags=no_wrap), hi, flags=no_wrap)
            p_lo = builder.bitcast(builder.gep(data, [at_lo], inbounds=True), vec.as_pointer())
            p_hi = builder.bitcast(builder.gep(data, [at_hi], inbounds=True), vec.as_pointer())
            body(p_lo, s_lo, p_hi, s_hi)
        return builder.load(bad)

    def _out(context, builder, signature, args):
        out = context.make_array(signature.args[3])(context, builder, args[3])
        return builder.bitcast(out.data, vec.as_pointer())

    @intrinsic
    def halves_scores(typingctx, table, wr, pairs, res):
        if not _typed(table, wr, pairs, res):
            return None
        sig = types.int64(table, wr, pairs, res)

        def codegen(context, builder, signature, args):
            accs = [cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * 4)) for _ in range(2)]

            def body(p_lo, s_lo, p_hi, s_hi):
                for acc, pointer, s in ((accs[0], p_lo, s_lo), (accs[1], p_hi, s_hi)):
                    product = builder.fmul(_splat(builder, s), builder.load(pointer, align=4), flags=["contract"])
                    builder.store(builder.fadd(builder.load(acc), product, flags=["contract"]), acc)

            bad = _blocks(context, builder, signature, args, body)
            builder.store(builder.fadd(builder.load(accs[0]), builder.load(accs[1])),
                          _out(context, builder, signature, args), align=4)
            return bad

        return sig, codegen

    @intrinsic
    def halves_hist(typingctx, table, wr, pairs, w4):
        if not _typed(table, wr, pairs, w4):
            return None
        sig = types.int64(table, wr, pairs, w4)

        def codegen(context, builder, signature, args):
            weights = builder.load(_out(context, builder, signature, args), align=4)

            def body(p_lo, s_lo, p_hi, s_hi):
                for pointer, s in ((p_lo, s_lo), (p_hi, s_hi)):
                    product = builder.fmul(_splat(builder, s), weights, flags=["contract"])
                    builder.store(builder.fadd(builder.load(pointer, align=4), product, flags=["contract"]),
                                  pointer, align=4)

            return _blocks(context, builder, signature, args, body)

        return sig, codegen

    def _lanes4(builder, x, k):
        return builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(i32, 4), [k] * 4))

    def _loop_q_h(context, builder, table_ty, table_v, halves_ty, halves_v, before, body, after):
        """for q < Q: state = before(q); for h < H: body(state, q, pointer to table[q, h] (<4 x float>*),
        halves[h] (<4 x float>)); after(state, q)."""
        table = context.make_array(table_ty)(context, builder, table_v)
        halves = context.make_array(halves_ty)(context, builder, halves_v)
        n_q, n_half = cgutils.unpack_tuple(builder, table.shape)[:2]
        with cgutils.for_range(builder, n_q) as q_loop:
            q = q_loop.index
            state = before(q)
            base = builder.mul(q, builder.mul(n_half, const(4), flags=no_wrap), flags=no_wrap)
            with cgutils.for_range(builder, n_half) as h_loop:
                h = h_loop.index
                at = builder.add(base, builder.mul(h, const(4), flags=no_wrap), flags=no_wrap)
                pointer = builder.bitcast(builder.gep(table.data, [at], inbounds=True), vec.as_pointer())
                half = builder.load(builder.bitcast(builder.gep(halves.data, [builder.mul(h, const(4))],
                                                                inbounds=True), vec.as_pointer()), align=4)
                body(state, q, pointer, half)
            after(state, q)

    def _typed_q44(table, halves, q44):
        return (_c_array(table, 3, types.float32) and _c_array(halves, 2, types.float32)
                and _c_array(q44, 3, types.float32))

    def _q44_row(context, builder, q44_ty, q44_v, q, k):
        """<4 x float>* to q44[q, k, :]."""
        q44 = context.make_array(q44_ty)(context, builder, q44_v)
        at = builder.add(builder.mul(q, const(16), flags=no_wrap), const(4 * k), flags=no_wrap)
        return builder.bitcast(builder.gep(q44.data, [at], inbounds=True), vec.as_pointer())

    @intrinsic
    def halves_build(typingctx, table, halves, rq44):
        """table[q, h, :] = sum_k halves[h, k] rq44[q, k, :] (halves float32 C [H, 4], rq44 float32 C [Q, 4, 4]:
        quarter q of 4 query rows, lanes last)."""
        if not _typed_q44(table, halves, rq44):
            return None
        sig = types.void(table, halves, rq44)

        def codegen(context, builder, signature, args):
            def before(q):
                return [builder.load(_q44_row(context, builder, signature.args[2], args[2], q, k), align=4)
                        for k in range(4)]

            def body(rows, q, pointer, half):
                out = builder.fmul(_lanes4(builder, half, 0), rows[0])
                for k in range(1, 4):
                    out = builder.fadd(out, builder.fmul(_lanes4(builder, half, k), rows[k], flags=["contract"]),
                                       flags=["contract"])
                builder.store(out, pointer, align=4)

            _loop_q_h(context, builder, signature.args[0], args[0], signature.args[1], args[1], before, body,
                      lambda rows, q: None)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def halves_contract(typingctx, table, halves, out44):
        """out44[q, k, :] = sum_h halves[h, k] table[q, h, :] (the values' histogram contracted with the halves;
        out44 float32 C [Q, 4, 4])."""
        if not _typed_q44(table, halves, out44):
            return None
        sig = types.void(table, halves, out44)

        def codegen(context, builder, signature, args):
            def before(q):
                return [cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * 4)) for _ in range(4)]

            def body(accs, q, pointer, half):
                row = builder.load(pointer, align=4)
                for k in range(4):
                    product = builder.fmul(_lanes4(builder, half, k), row, flags=["contract"])
                    builder.store(builder.fadd(builder.load(accs[k]), product, flags=["contract"]), accs[k])

            def after(accs, q):
                for k in range(4):
                    builder.store(builder.load(accs[k]), _q44_row(context, builder, signature.args[2], args[2], q, k),
                                  align=4)

            _loop_q_h(context, builder, signature.args[0], args[0], signature.args[1], args[1], before, body, after)
            return context.get_dummy_value()

        return sig, codegen

    _HALVES = halves_scores, halves_hist, halves_build, halves_contract
    return _HALVES
