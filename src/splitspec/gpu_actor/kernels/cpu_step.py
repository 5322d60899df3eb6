"""The decoder layers of a few tokens on the CPU as compiled code over a table of addresses: the draft's
in one numba call; the verifier's in one too where it posts to the CPU actors' leased slots itself
(``verify_layers``, ``protocol.lane``), otherwise in two calls per Linear group around the residual's
submit and gather.

Op by op, a pass makes ~15 calls per Linear group through torch and numba (the rotations, the base
product, the norm, RoPE, attention's products and softmax, the MLP's activation), and for one token each
call costs more than its arithmetic. A GPU replays such a step as a CUDA graph; on the CPU the loop itself
is compiled. It calls the kernels the op-by-op path calls (``cpu_base.kernel``, ``kron.kron_rows``) at the
addresses the model's ``Product``\\ s and ``Rotation``\\ s already hold, collected once into one int64 row
per layer (``LAYER`` fields, laid out below), and does the small parts in plain loops. The numbers are the
op-by-op path's up to the order of fp32 additions (``tests/test_gpu_actor_model.py`` and
``tests/test_models_architectures.py`` hold them to it).

A layer's row: four groups (qkv, o, gate_up, down) of ``GROUP`` fields each, then the addresses of the
output norms (attn_out, mlp_out) and of the q/k norms, 0 where the model has none, then its RoPE kind (0
full, 1 sliding) and whether its q/k norms span all heads. A group's fields: its base product's
addresses, rows, code words and whether it may use tiles; the kron fields of its input rotation; its runs
of equal-width Linears (first row, width, count, their output rotation's kron fields); each Linear's bias
address or 0. ``step_fields`` (model.py) fills them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from splitspec.gpu_actor.kernels.kron import ONE, axpy_rows, kron_rows, lane_rows
from splitspec.kernels.cpu_base.kernel import kernel as base_kernel
from splitspec.kernels.cpu_base.kernel import table_scratch
from splitspec.kernels.ir import F32, F32_PTR, F64_PTR, I64_PTR, U8_PTR, c64, data, loop, splat
from splitspec.kernels.residual import drivers
from splitspec.protocol import lane
from splitspec.protocol.messages import BASE_SHARE_TOKENS
from splitspec.quantize.format import CODE_WORD

MAX_TOKENS = 576  # a pass of up to this many rows (all its sequences) runs here; more op by op
LOOP_TOKENS = 64  # up to this many rows ``attend``'s loops; more, the model's own attention (sdpa)

QKV, O, GATE_UP, DOWN = range(4)
KRON = 7  # (F1 address, a, b, input signs' address, output signs' address, signs' length, pairs)
BASE = 0  # codes, nibble codes, scales, block-major scales, levels (addresses), rows, code words, tiled
ROWS, WORDS, TILED = 5, 6, 7
ROTATE_IN = 8  # KRON fields
RUNS = ROTATE_IN + KRON  # the number of runs, then each run's fields
RUN = 3 + KRON  # first row, width, count, KRON fields
MAX_RUNS = 3
BIASES = RUNS + 1 + RUN * MAX_RUNS  # one per Linear, in row order
MAX_LINEARS = 3
GROUP = BIASES + MAX_LINEARS
NORMS = 4 * GROUP  # attn_out, mlp_out, q_norm, k_norm
KIND = NORMS + 4
QK_FULL = KIND + 1  # whether the q/k norms span all heads (OLMo 2) rather than each head
LAYER = QK_FULL + 1

NO_NORM = -1.0  # a group's eps leg where no RMS norm is folded into its input rotation
_GELU_C = np.float32(math.sqrt(2 / math.pi))  # GELU tanh form: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))


@njit(inline="always", cache=True)
def _kron(t, at, x_at, stride, rows, row_len, y_at):
    """``kron_rows`` with the KRON fields at ``at``, x's and y's rows ``stride`` apart."""
    f1, a, b, s_in, s_out, s_len, pairs = t[at], t[at + 1], t[at + 2], t[at + 3], t[at + 4], t[at + 5], t[at + 6]
    kron_rows(x_at, stride, rows, row_len, f1, a, b, s_in, s_out, s_len, pairs, y_at, stride)


@njit(cache=True)
def _rotate_rows_in(t, g, eps_leg, x, x_rot, center):
    """x' [n, d_in] = H·S·x for group ``g``, each row divided by hypot(‖x‖, eps_leg) where a norm is folded in;
    with ``center`` (a LayerNorm) each row's mean taken off x first, in a copy (x is the residual stream)."""
    n, d = x.shape
    if center and eps_leg != NO_NORM:
        x = x.copy()
        for r in range(n):
            mean = np.float32(0.0)
            for j in range(d):
                mean += x[r, j]
            mean /= np.float32(d)
            for j in range(d):
                x[r, j] -= mean
    _kron(t, g * GROUP + ROTATE_IN, x.ctypes.data, d, n, d, x_rot.ctypes.data)
    if eps_leg != NO_NORM:
        for r in range(n):
            inv = np.float32(1.0) / np.float32(math.sqrt(_squares(x[r]) + eps_leg * eps_leg))
            for j in range(d):
                x_rot[r, j] *= inv


@njit(fastmath=True, cache=True)
def _squares(row):
    """Σ row², in vector lanes (fastmath lets LLVM reassociate the sum): one row's order, whatever the
    pass's row count, so that a row's norm does not depend on the tokens beside it."""
    ss = np.float32(0.0)
    for j in range(row.shape[0]):
        ss += row[j] * row[j]
    return ss


@njit(cache=True)
def _base_rows(t, g, x_rot, y, split, threads, tables_at):
    """y = x'·dequant(Q_base)ᵀ for group ``g`` (y [n, rows]) over each row's first ``split`` code words."""
    at = g * GROUP + BASE
    n = x_rot.shape[0]
    base_kernel(t[at], t[at + 1], t[at + 2], t[at + 3], t[at + 4], x_rot.ctypes.data, y.ctypes.data, n, t[at + ROWS],
                split, t[at + WORDS], threads, t[at + TILED] != 0, tables_at)  # fmt: skip


@njit(cache=True)
def shared_tokens(n, chunk):
    """How many of a pass's n rows, sent in requests of ``chunk`` rows (the last one the rest), go in requests
    of at least ``BASE_SHARE_TOKENS`` rows, whose replies carry the CPU actors' share of the base: the
    first ones."""
    if chunk < BASE_SHARE_TOKENS:
        return 0
    whole = (n - 1) // chunk * chunk
    return n if n - whole >= BASE_SHARE_TOKENS else whole


@njit(cache=True)
def _rotate_rows_out(t, g, y, z):
    """z [n, rows] = each Linear's rows of y rotated back (S_o·H_oᵀ), its bias added."""
    n, rows = y.shape
    linear = 0
    for k in range(t[g * GROUP + RUNS]):
        at = g * GROUP + RUNS + 1 + k * RUN
        first, width, count = t[at], t[at + 1], t[at + 2]
        _kron(t, at + 3, y.ctypes.data + 4 * first, rows, n, width * count, z.ctypes.data + 4 * first)
        for c in range(count):
            bias_at = t[g * GROUP + BIASES + linear]
            if bias_at:
                bias = numba.carray(F32_PTR(bias_at), width)
                for r in range(n):
                    for j in range(width):
                        z[r, first + c * width + j] += bias[j]
            linear += 1


@njit(inline="always", cache=True)
def _rms_norm(x, w_at, eps):
    """x (a row) ← x / rms(x) ⊙ w, in place."""
    d = x.shape[0]
    w = numba.carray(F32_PTR(w_at), d)
    ss = np.float32(0.0)
    for j in range(d):
        ss += x[j] * x[j]
    inv = np.float32(1.0) / np.float32(math.sqrt(ss / d + eps))
    for j in range(d):
        x[j] = x[j] * inv * w[j]


@njit(inline="always", cache=True)
def _reorder(x, order_at, spare):
    """x (a head) ← x[order], the head's dimensions in the order RoPE takes them (``ArchSpec.rope_order``)."""
    d = x.shape[0]
    order = numba.carray(I64_PTR(order_at), d)
    for j in range(d):
        spare[j] = x[order[j]]
    x[:] = spare


@njit(inline="always", cache=True)
def _rope(x, cos, sin, factor, out):
    """out = (x·cos + rotate_half(x)·sin)·factor for one head."""
    half = x.shape[0] // 2
    for j in range(half):
        out[j] = (x[j] * cos[j] - x[j + half] * sin[j]) * factor
        out[j + half] = (x[j + half] * cos[j + half] + x[j] * sin[j + half]) * factor


@intrinsic
def _pow2(typingctx, k):
    """2^k as fp32 for an int32 k in [-126, 127]: k + 127 shifted into the exponent field."""
    if k != types.int32:
        return None

    def codegen(context, builder, sig, args):
        biased = builder.add(args[0], ir.Constant(ir.IntType(32), 127))
        return builder.bitcast(builder.shl(biased, ir.Constant(ir.IntType(32), 23)), ir.FloatType())

    return types.float32(k), codegen


@intrinsic
def _top(typingctx, src, at, count):
    """max(src[at : at + count]) for count ≥ 1: 16 lanes of maxnum at a time, then the rest one by one (the
    loop vectorizer left a max's reduction scalar, a third of a prompt's softmax)."""
    sig = types.float32(src, at, count)

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(F32, 16)
        base = data(context, builder, sig.args[0], args[0])

        def llvm(name, result, *operands):
            return cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, operands), name)

        vmax, smax = llvm("llvm.maxnum.v16f32", v16, v16, v16), llvm("llvm.maxnum.f32", F32, F32, F32)
        fold = llvm("llvm.vector.reduce.fmax.v16f32", F32, v16)

        def at(i):
            return builder.gep(base, [builder.add(args[1], i)])

        def lanes(i, carried):
            return [builder.call(vmax, [carried[0], builder.load(builder.bitcast(at(i), v16.as_pointer()), align=4)])]

        def one(j, carried):
            return [builder.call(smax, [carried[0], builder.load(at(j))])]

        i, (top,) = loop(builder, c64(0), args[2], 16, [splat(builder, builder.load(at(c64(0))), 16)], lanes)
        _, (top,) = loop(builder, i, args[2], 1, [builder.call(fold, [top])], one)
        return top

    return sig, codegen


_LOG2E = np.float32(1.4426950408889634)
_FLOOR = np.float32(-87.0)  # e^x stays a normal fp32 down to here
_LN2_HI, _LN2_LO = np.float32(0.693145751953125), np.float32(1.428606765330187e-06)  # ln 2 in two parts


@njit(inline="always", cache=True, fastmath=True)
def _exp(x):
    """e^x for fp32 x ≤ 0 within ~2 ulp (from x < -87, e^-87: a tiny normal, not 0), in operations the loop
    vectorizer takes: x = k·ln 2 + r with |r| ≤ ln 2 / 2, e^r by its degree-6 Taylor sum."""
    x = max(x, _FLOOR)
    k = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - k * _LN2_HI - k * _LN2_LO
    p = (((((_C6 * r + _C5) * r + _C4) * r + _C3) * r + _C2) * r + _C1) * r + _C1
    return p * _pow2(np.int32(k))


_C1, _C2, _C3, _C4, _C5, _C6 = (np.float32(1 / math.factorial(i)) for i in range(1, 7))
_LOWEST = np.float32(-3.0e38)  # below every score: the max's start (fastmath assumes no infinities)


@njit(inline="always", cache=True)
def _weighted_sum(out, out_at, w, w_at, src, src_at, src_stride, count, width):
    """out[out_at + c] = Σ_{k < count} w[w_at + k] · src[src_at + src_stride·k + c] for c < ``width`` (a
    multiple of 8), all by flat index: 64 columns at a time in registers (``kron.axpy_rows``), then 32, 16, 8."""
    done = 0
    while width - done >= 64:
        axpy_rows(out, out_at + done, w, w_at, 0, src, src_at + done, src_stride, count, 64, 1)
        done += 64
    if width - done >= 32:
        axpy_rows(out, out_at + done, w, w_at, 0, src, src_at + done, src_stride, count, 32, 1)
        done += 32
    if width - done >= 16:
        axpy_rows(out, out_at + done, w, w_at, 0, src, src_at + done, src_stride, count, 16, 1)
        done += 16
    if width - done >= 8:
        axpy_rows(out, out_at + done, w, w_at, 0, src, src_at + done, src_stride, count, 8, 1)


@njit(inline="always", cache=True)
def _weighted_sums(out, out_at, w, w_at, rows, src, src_at, src_stride, count, width, w_stride):
    """``_weighted_sum`` for ``rows`` rows of weights (``w_stride`` apart) into as many ``width``-wide outputs
    in a row: the query heads of one kv head, several per call where their sums fit in the registers, so
    that each value row is read once for them. Every output's sum runs over k in the same order either way."""
    p = 0
    if width == 64:
        while rows - p >= 4:
            axpy_rows(out, out_at + 64 * p, w, w_at + w_stride * p, w_stride, src, src_at, src_stride, count, 64, 4)
            p += 4
        if rows - p == 3:
            axpy_rows(out, out_at + 64 * p, w, w_at + w_stride * p, w_stride, src, src_at, src_stride, count, 64, 3)
            p += 3
        elif rows - p == 2:
            axpy_rows(out, out_at + 64 * p, w, w_at + w_stride * p, w_stride, src, src_at, src_stride, count, 64, 2)
            p += 2
    elif width == 128:
        while rows - p >= 2:
            axpy_rows(out, out_at + 128 * p, w, w_at + w_stride * p, w_stride, src, src_at, src_stride, count, 128, 2)
            p += 2
    while p < rows:
        _weighted_sum(out, out_at + width * p, w, w_at + w_stride * p, src, src_at, src_stride, count, width)
        p += 1


@njit(cache=True, fastmath=True)
def attention(z, layer, k_cache, v_cache, start, mask, cos, sin, scale, heads, q_norm_at, k_norm_at, eps, cap, order_at,
              factor_at, out):  # fmt: skip
    """The block's attention from the qkv group's output z [n, (heads + 2·kv)·head_dim]: K (normed where
    ``k_norm_at``, then RoPE) and V into slots [start, start + n) of the caches [layers, slots, kv,
    head_dim], then each query head (normed, RoPE times ``scale``) over the slots ``mask`` [n, start + n]
    lets it see (each score capped as cap·tanh(score / cap) where ``cap`` is not 0: Gemma 2), into out [n,
    heads·head_dim]. The common head sizes get a copy of the loops with the size
    a constant, which the compiler unrolls (half the time of the general copy at 64)."""
    d = k_cache.shape[3]
    if d == 64:
        _attention(z, layer, k_cache, v_cache, start, mask, cos, sin, scale, heads, q_norm_at, k_norm_at, eps, cap,
                   order_at, factor_at, out, 64)  # fmt: skip
    elif d == 128:
        _attention(z, layer, k_cache, v_cache, start, mask, cos, sin, scale, heads, q_norm_at, k_norm_at, eps, cap,
                   order_at, factor_at, out, 128)  # fmt: skip
    else:
        _attention(z, layer, k_cache, v_cache, start, mask, cos, sin, scale, heads, q_norm_at, k_norm_at, eps, cap,
                   order_at, factor_at, out, d)  # fmt: skip


@njit(cache=True)
def rope_rows(z, layer, k_cache, v_cache, start, cos, sin, scale, heads, q):
    """``attention``'s first steps for a block that sdpa then attends (a layer with no q/k norm and RoPE in
    the model's order): K (RoPE) and V of z [n, (heads + 2·kv)·head_dim] into slots [start, start + n) of
    the caches [layers, slots, kv, head_dim], and the queries, RoPE times ``scale``, into q [n, heads,
    head_dim]; ``cos``/``sin`` [n, head_dim] the rows' RoPE."""
    kv, d = k_cache.shape[2], k_cache.shape[3]
    for r in range(z.shape[0]):
        for j in range(kv):
            k = z[r, (heads + j) * d : (heads + j + 1) * d]
            _rope(k, cos[r], sin[r], np.float32(1.0), k_cache[layer, start + r, j])
            v_cache[layer, start + r, j, :] = z[r, (heads + kv + j) * d : (heads + kv + j + 1) * d]
        for h in range(heads):
            _rope(z[r, h * d : (h + 1) * d], cos[r], sin[r], scale, q[r, h])


# Blocks of the scores of many query rows: SLOT_BLOCK slots (one register) by up to QUERY_BLOCK query vectors
# (rows × the heads of one kv head) in registers (``kron.axpy_rows``), each K row read once per block of queries,
# from BLOCKED_QUERIES query vectors a kv head on: fewer do not pay for turning the K rows into columns (measured,
# benchmarks/README.md)
SLOT_BLOCK, QUERY_BLOCK, BLOCKED_QUERIES = 16, 8, 24


@njit(inline="always", cache=True, fastmath=True)
def _attention(z, layer, k_cache, v_cache, start, mask, cos, sin, scale, heads, q_norm_at, k_norm_at, eps, cap,
               order_at, factor_at, out, d):  # fmt: skip
    """``attention`` with head size ``d``. The query heads that share a kv head go together, so that each K
    and V row is read once for all of them; from ``BLOCKED_QUERIES`` of them on (a prompt's part, a tree's
    check), their scores come a block of slots by a block of queries at a time (``_block_scores``), whose
    sums stay in registers; fewer (a decode step) take one dot product a slot."""
    n = z.shape[0]
    kv = k_cache.shape[2]
    total = start + n
    row, spare = np.empty(d, np.float32), np.empty(d, np.float32)
    for r in range(n):
        for j in range(kv):
            row[:] = z[r, (heads + j) * d : (heads + j + 1) * d]
            if k_norm_at:
                _rms_norm(row, k_norm_at, eps)
            if order_at:
                _reorder(row, order_at, spare)
            _rope(row, cos[r], sin[r], np.float32(1.0), k_cache[layer, start + r, j])
            v_cache[layer, start + r, j, :] = z[r, (heads + kv + j) * d : (heads + kv + j + 1) * d]
    per_kv = heads // kv
    blocked = n * per_kv >= BLOCKED_QUERIES
    q = np.empty((n if blocked else 1, per_kv, d), np.float32)
    scores = np.empty((n if blocked else 1, per_kv, total), np.float32)
    seen = np.empty(total, np.float32)
    if blocked:  # each row's first and last visible slot, for the blocks of scores to skip
        seen_from, seen_to = np.full(n, total, np.int64), np.full(n, -1, np.int64)
        for r in range(n):
            for s in range(total):
                if mask[r, s]:
                    seen_from[r] = min(seen_from[r], s)
                    seen_to[r] = s
    for j in range(kv):
        for r in range(n):
            at = r if blocked else 0
            for p in range(per_kv):
                hh = j * per_kv + p
                row[:] = z[r, hh * d : (hh + 1) * d]
                if q_norm_at:
                    _rms_norm(row, q_norm_at, eps)
                if order_at:
                    _reorder(row, order_at, spare)
                factor = scale * numba.carray(F32_PTR(factor_at), n)[r] if factor_at else scale
                _rope(row, cos[r], sin[r], factor, q[at, p])
            if not blocked:
                _row_scores(q[0], k_cache, layer, j, mask[r], scores[0])
                _softmax_sums(scores[0], mask[r], seen, cap, out, (r * heads + j * per_kv) * d, v_cache, layer, j)
        if blocked:
            _block_scores(q, k_cache, layer, j, seen_from, seen_to, scores)
            for r in range(n):
                _softmax_sums(scores[r], mask[r], seen, cap, out, (r * heads + j * per_kv) * d, v_cache, layer, j)


@njit(inline="always", cache=True, fastmath=True)
def _row_scores(q, k_cache, layer, j, visible, scores):
    """scores [heads, slots] of one row's query heads q [heads, d] of kv head j, where ``visible`` (the
    others are ``_softmax_sums``'s to mask)."""
    d = q.shape[1]
    for s in range(scores.shape[1]):
        if visible[s]:
            for p in range(q.shape[0]):
                acc = np.float32(0.0)
                for c in range(d):
                    acc += q[p, c] * k_cache[layer, s, j, c]
                scores[p, s] = acc


@njit(cache=True, fastmath=True)
def _block_scores(q, k_cache, layer, j, first, last, scores):
    """scores [n, heads, slots] of every row's query heads q [n, heads, d] of kv head j: per block of
    ``SLOT_BLOCK`` slots, their K rows turned into columns once, then ``QUERY_BLOCK`` query vectors at a time
    against them (``kron.axpy_rows``); a block that none of a group's rows sees (row r sees slots ``first[r]``
    .. ``last[r]`` at most) is skipped (its scores are masked out after)."""
    n, per_kv, d = q.shape
    total = scores.shape[2]
    vectors = n * per_kv
    flat = q.reshape(-1)
    keys = np.zeros(d * SLOT_BLOCK, np.float32)  # [d, SLOT_BLOCK]: a block's K rows as columns
    block = np.empty((2, QUERY_BLOCK * SLOT_BLOCK), np.float32)
    out = scores.reshape(-1)  # [n·heads, slots]: query vector v's scores from v·total
    half = d // 2
    for s0 in range(0, total, SLOT_BLOCK):
        m = min(SLOT_BLOCK, total - s0)
        for i in range(m):
            for c in range(d):
                keys[c * SLOT_BLOCK + i] = k_cache[layer, s0 + i, j, c]
        for i in range(m, SLOT_BLOCK):
            for c in range(d):
                keys[c * SLOT_BLOCK + i] = np.float32(0.0)
        for v0 in range(0, vectors, QUERY_BLOCK):
            count = min(QUERY_BLOCK, vectors - v0)
            seen = False
            for r in range(v0 // per_kv, (v0 + count - 1) // per_kv + 1):
                seen = seen or (first[r] < s0 + m and last[r] >= s0)
            if not seen:
                continue
            for h in range(2):  # each half of the columns its own sums, added after: a shorter chain of roundings
                at, keys_at = v0 * d + h * half, h * half * SLOT_BLOCK
                if count == QUERY_BLOCK:
                    axpy_rows(block[h], 0, flat, at, d, keys, keys_at, SLOT_BLOCK, half, SLOT_BLOCK, QUERY_BLOCK)
                else:
                    for u in range(count):
                        axpy_rows(block[h], u * SLOT_BLOCK, flat, at + u * d, d, keys, keys_at, SLOT_BLOCK, half,
                                  SLOT_BLOCK, 1)  # fmt: skip
            for u in range(count):  # the halves' sum; a full block's in vector lanes (element by element, it
                at = (v0 + u) * total + s0  # cost half as much as the block's multiply-adds)
                if m == SLOT_BLOCK:
                    lane_rows(out, at, block[0], u * SLOT_BLOCK, block[1], u * SLOT_BLOCK, ONE, SLOT_BLOCK, True)
                else:
                    for i in range(m):
                        out[at + i] = block[0, u * SLOT_BLOCK + i] + block[1, u * SLOT_BLOCK + i]


@njit(inline="always", cache=True, fastmath=True)
def _softmax_sums(scores, visible, seen, cap, out, out_at, v_cache, layer, j):
    """One row's attention output for the query heads of kv head j from their scores [heads, slots] (those
    it does not see, ``visible`` 0, whatever they hold), capped as cap·tanh(score / cap) where ``cap`` is not
    0 (Gemma 2), into ``out``'s flat ``out_at``: softmax, then the weighted sums of the V rows."""
    per_kv = scores.shape[0]
    kv, d = v_cache.shape[2], v_cache.shape[3]
    total = scores.shape[1]
    while total > 1 and not visible[total - 1]:  # the slots after the last one it sees (a causal row's) add 0
        total -= 1
    hidden = 0
    for s in range(total):
        hidden += visible[s] == 0
    if hidden:  # a tree's row or a window's (a causal row sees every slot up to its last)
        for s in range(total):
            seen[s] = np.float32(1.0) if visible[s] else np.float32(0.0)
        for p in range(per_kv):
            for s in range(total):
                if not visible[s]:
                    scores[p, s] = _LOWEST
    if cap != 0:  # a pass of its own, so that the products' loop stays as it is without a cap
        for p in range(per_kv):
            for s in range(total):
                if visible[s]:
                    scores[p, s] = np.float32(cap * math.tanh(scores[p, s] / cap))
    for p in range(per_kv):
        top = _top(scores, p * scores.shape[1], total)
        norm = np.float32(0.0)
        for s in range(total):
            e = _exp(scores[p, s] - top)
            if hidden:
                e *= seen[s]
            scores[p, s] = e
            norm += e
        inv = np.float32(1.0) / norm
        for s in range(total):
            scores[p, s] *= inv
    values_at = (layer * v_cache.shape[1] * kv + j) * d  # V[layer, slot, j] is values_at + slot·kv·d
    _weighted_sums(out, out_at, scores, 0, per_kv, v_cache, values_at, kv * d, total, d, scores.shape[1])


@njit(cache=True)
def _add_output(h, z, norm_at, eps):
    """h += z, z normed first where the layer has an output norm (``norm_at``)."""
    n, d = h.shape
    for r in range(n):
        if norm_at:
            _rms_norm(z[r, :d], norm_at, eps)
        for j in range(d):
            h[r, j] += z[r, j]


@njit(cache=True, error_model="numpy")
def activate(z, gelu, out):
    """out [n, inter] = act(gate) ⊙ up from the gate_up group's output z [n, 2·inter]: SiLU, or GELU's tanh
    form, both through ``_exp`` of a non-positive argument (so that the loops vectorize): σ(x) = 1 / (1 +
    e^-x) or e^x / (1 + e^x), tanh(u) = ±(1 - e^-2|u|) / (1 + e^-2|u|). ``error_model="numpy"`` drops the
    divisions' zero checks (1 + e ≥ 1), which kept the loops scalar."""
    n, inter = out.shape
    one, half = np.float32(1.0), np.float32(0.5)
    for r in range(n):
        if gelu:
            for i in range(inter):
                x = z[r, i]
                u = _GELU_C * (x + np.float32(0.044715) * x * x * x)
                e = _exp(np.float32(-2.0) * abs(u))
                t = (one - e) / (one + e)
                out[r, i] = half * x * (one + (t if u >= 0 else -t)) * z[r, inter + i]
        else:
            for i in range(inter):
                x = z[r, i]
                e = _exp(-abs(x))
                out[r, i] = x * ((one if x >= 0 else e) / (one + e)) * z[r, inter + i]


# A pass's context: int64 fields, addresses and sizes (the floats as their float64 bits), so that each
# compiled call takes ints alone (a call's array arguments cost more to unbox than its work for one token).
TABLE, EPS_LEGS, LAYERS, H, TOKENS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = range(9)
SEQUENCES, SEQUENCE_TABLE, SCALE, EPS, GELU, THREADS, X, Y, Z, ATTN, ACT, SOFTCAP, ROPE_ORDER = range(9, 22)
CENTER, PARALLEL = 22, 23  # Cohere: LayerNorms (rows centred before the norm); attention and MLP side by side
TABLES = 24  # the base's byte tables for THREADS numba threads (``cpu_base.kernel.table_scratch``)
# From SHARE_FROM + g: group g's first code word of the base that the CPU actors multiply in requests of at
# least ``BASE_SHARE_TOKENS`` rows (``EngineConfig.base_share``; its words: none); CHUNK: a request's rows.
SHARE_FROM, CHUNK = 25, 29
CONTEXT = 30
# Each sequence of a pass (its rows of the hidden states, its cache, mask and RoPE): one row of int64
# fields in the context's sequence table.
FIRST_ROW, ROWS_OF, K_CACHE, V_CACHE, SLOTS, START, MASKS, COS, SIN, Q_FACTOR = range(10)
SEQUENCE = 10


@njit(inline="always", cache=True)
def _context(ctx_at):
    return numba.carray(I64_PTR(ctx_at), CONTEXT)


@njit(inline="always", cache=True)
def _float(ctx_at, field):
    return numba.carray(F64_PTR(ctx_at + 8 * field), 1)[0]


@njit(inline="always", cache=True)
def _row(c, layer):
    return numba.carray(I64_PTR(c[TABLE] + 8 * LAYER * layer), LAYER)


@njit(inline="always", cache=True)
def _next_input(c, layer, g, x_at, width):
    """x' of group ``g`` into the context's X from its input [tokens, width] at ``x_at``."""
    n = c[TOKENS]
    t = _row(c, layer)
    x = numba.carray(F32_PTR(x_at), (n, width))
    x_rot = numba.carray(F32_PTR(c[X]), (n, t[g * GROUP + WORDS] * CODE_WORD))
    eps_leg = numba.carray(F32_PTR(c[EPS_LEGS]), (c[LAYERS], 4))[layer, g]
    _rotate_rows_in(t, g, eps_leg, x, x_rot, c[CENTER] != 0)


@njit(cache=True)
def begin(ctx_at):
    """x' of layer 0's qkv group from the hidden states."""
    c = _context(ctx_at)
    _next_input(c, 0, QKV, c[H], c[HIDDEN])


@njit(cache=True)
def base(ctx_at, layer, g):
    """Y = x'·dequant(Q_base)ᵀ for group ``g`` of ``layer``, but for the CPU actors' share of its code words
    (from SHARE_FROM) in the rows whose requests carry it (``shared_tokens``): their replies add it in."""
    c = _context(ctx_at)
    n, t = c[TOKENS], _row(c, layer)
    words, split = t[g * GROUP + WORDS], c[SHARE_FROM + g]
    x_rot = numba.carray(F32_PTR(c[X]), (n, words * CODE_WORD))
    y = numba.carray(F32_PTR(c[Y]), (n, t[g * GROUP + ROWS]))
    q = shared_tokens(n, c[CHUNK]) if split < words else 0
    if q:
        _base_rows(t, g, x_rot[:q], y[:q], split, c[THREADS], c[TABLES])
    if q < n:
        _base_rows(t, g, x_rot[q:], y[q:], words, c[THREADS], c[TABLES])


@njit(cache=True)
def finish(ctx_at, layer, g):
    """Group ``g`` of ``layer`` from Y, its base product with the residual's rows already added in (none:
    the draft), rotated back into Z; then what follows it up to the next group's x' (the qkv group stops at
    Z: ``attend`` takes it from there). After the last layer's down group, the hidden states are final."""
    c = _context(ctx_at)
    n, d, t = c[TOKENS], c[HIDDEN], _row(c, layer)
    rows = t[g * GROUP + ROWS]
    y = numba.carray(F32_PTR(c[Y]), (n, rows))
    z = numba.carray(F32_PTR(c[Z]), (n, rows))
    _rotate_rows_out(t, g, y, z)
    if g == QKV:
        return
    h = numba.carray(F32_PTR(c[H]), (n, d))
    eps = _float(ctx_at, EPS)
    if g == O:
        if c[PARALLEL]:  # the MLP's x' from the layer's input, before the attention's output joins it
            _next_input(c, layer, GATE_UP, c[H], d)
            _add_output(h, z, t[NORMS], eps)
        else:
            _add_output(h, z, t[NORMS], eps)
            _next_input(c, layer, GATE_UP, c[H], d)
    elif g == GATE_UP:
        act = numba.carray(F32_PTR(c[ACT]), (n, rows // 2))
        activate(z, c[GELU] != 0, act)
        _next_input(c, layer, DOWN, c[ACT], rows // 2)
    else:
        _add_output(h, z, t[NORMS + 1], eps)
        if layer + 1 < c[LAYERS]:
            _next_input(c, layer + 1, QKV, c[H], d)


@njit(cache=True)
def attend(ctx_at, layer):
    """Attention from the qkv group's Z, each sequence's rows against its own cache (K and V into it), then
    x' of the o group."""
    c = _context(ctx_at)
    t = _row(c, layer)
    heads, kv, hd = c[HEADS], c[KV_HEADS], c[HEAD_DIM]
    kind = t[KIND]
    scale, eps, cap, order_at = _float(ctx_at, SCALE), _float(ctx_at, EPS), _float(ctx_at, SOFTCAP), c[ROPE_ORDER]
    width = (heads + 2 * kv) * hd
    for q in range(c[SEQUENCES]):
        e = numba.carray(I64_PTR(c[SEQUENCE_TABLE] + 8 * SEQUENCE * q), SEQUENCE)
        first, n, start = e[FIRST_ROW], e[ROWS_OF], e[START]
        k_cache = numba.carray(F32_PTR(e[K_CACHE]), (c[LAYERS], e[SLOTS], kv, hd))
        v_cache = numba.carray(F32_PTR(e[V_CACHE]), (c[LAYERS], e[SLOTS], kv, hd))
        masks = numba.carray(U8_PTR(e[MASKS]), (2, n, start + n))
        cos = numba.carray(F32_PTR(e[COS]), (2, n, hd))
        sin = numba.carray(F32_PTR(e[SIN]), (2, n, hd))
        z = numba.carray(F32_PTR(c[Z] + 4 * first * width), (n, width))
        attn = numba.carray(F32_PTR(c[ATTN] + 4 * first * heads * hd), (n, heads * hd))
        q_norm_at, k_norm_at = t[NORMS + 2], t[NORMS + 3]
        if t[QK_FULL]:  # normed over all heads here, so not per head below
            for r in range(n):
                _rms_norm(z[r, : heads * hd], q_norm_at, eps)
                _rms_norm(z[r, heads * hd : (heads + kv) * hd], k_norm_at, eps)
            q_norm_at = k_norm_at = 0
        attention(z, layer, k_cache, v_cache, start, masks[kind], cos[kind], sin[kind], scale, heads,
                  q_norm_at, k_norm_at, eps, cap, order_at, e[Q_FACTOR], attn)  # fmt: skip
    o_input(ctx_at, layer)


@njit(cache=True)
def o_input(ctx_at, layer):
    """x' of the o group from the attention's output in the context's ATTN (``attend``'s last step; a pass
    whose attention ran elsewhere calls it alone)."""
    c = _context(ctx_at)
    _next_input(c, layer, O, c[ATTN], c[HEADS] * c[HEAD_DIM])


@njit(cache=True)
def draft_layers(ctx_at):
    """Every decoder layer of the draft (base products alone), the context's hidden states in place."""
    begin(ctx_at)
    for layer in range(_context(ctx_at)[LAYERS]):
        for g in range(4):
            base(ctx_at, layer, g)
            finish(ctx_at, layer, g)
            if g == QKV:
                attend(ctx_at, layer)


@njit(cache=True)
def held(ctx_at, layer, g, fields_at, levels):
    """Y[:, :r] += x'·dequant(R)ᵀ for the first r rows of group ``g``'s residual, the ones the engine keeps
    (``DeviceResidual``, ``EngineConfig.resident_bytes``), by the CPU actors' own kernel on this thread
    (``fields_at``: their ``ResidualMatrix.fields``; x' rounded to ``levels``, 0 for fp32, as the actors round
    it) while the actors multiply the rest."""
    c = _context(ctx_at)
    n = c[TOKENS]
    f = numba.carray(I64_PTR(fields_at), drivers.MATRIX)
    rows = f[drivers.ROWS]
    out = np.empty((n, rows), np.float32)
    drivers.serial_kernel(fields_at, numba.carray(F32_PTR(c[X]), (n, f[drivers.D_IN])), levels, 1, out)
    y = numba.carray(F32_PTR(c[Y]), (n, _row(c, layer)[g * GROUP + ROWS]))
    for i in range(n):
        for j in range(rows):
            y[i, j] += out[i, j]


# What ``verify_layers`` adds up, in seconds (float64): the posts, the base products, the waits, attention,
# the engine's own residual rows.
SUBMIT_S, BASE_S, WAIT_S, ATTENTION_S, HELD_S = range(5)
TIMES = 5


@njit(inline="always", cache=True)
def _post(c, lanes, count, chunk, layer, g):
    """Each ``chunk`` rows of group ``g``'s x' posted to their lanes (one per actor, in row order): 0, or 1
    where a post failed (Python's wait raises its error)."""
    n = c[TOKENS]
    actors = count // ((n + chunk - 1) // chunk)
    d_in = _row(c, layer)[g * GROUP + WORDS] * CODE_WORD
    for k in range(count):
        first = k // actors * chunk
        if lane.post(lanes[k], layer, g, c[X] + 4 * first * d_in, min(chunk, n - first)):
            return 1
    return 0


@njit(inline="always", cache=True)
def _answered(lanes, count):
    for k in range(count):  # noqa: SIM110 (numba compiles no generator for all())
        if not lane.answered(lanes[k]):
            return False
    return True


@njit(inline="always", cache=True)
def _add_replies(c, lanes, count, chunk, layer, g):
    """Each lane's reply added into Y at its rows and columns."""
    n = c[TOKENS]
    actors = count // ((n + chunk - 1) // chunk)
    y = numba.carray(F32_PTR(c[Y]), (n, _row(c, layer)[g * GROUP + ROWS]))
    for k in range(count):
        first = k // actors * chunk
        r_at, width, column = lane.reply(lanes[k])
        r = numba.carray(F32_PTR(r_at), (min(chunk, n - first), width))
        for i in range(r.shape[0]):
            y_i, r_i = y[first + i, column : column + width], r[i]  # row slices: the loop vectorizes
            for j in range(width):
                y_i[j] += r_i[j]


@njit(inline="always", cache=True)
def _finish_group(ctx_at, c, lanes, count, chunk, layer, g, times, clock, attend_elsewhere):
    """The replies added into Y and the group finished; after the qkv group its attention, timed, or False
    where that is Python's (``attend_elsewhere``)."""
    _add_replies(c, lanes, count, chunk, layer, g)
    finish(ctx_at, layer, g)
    if g == QKV:
        if attend_elsewhere:
            return False
        t0 = lane.now_ns(clock)
        attend(ctx_at, layer)
        times[ATTENTION_S] += (lane.now_ns(clock) - t0) * 1e-9
    return True


@njit(cache=True)
def verify_layers(ctx_at, lanes_at, count, chunk, step, resumed, times_at, held_at, levels, attend_elsewhere):
    """The verifier's layers from ``step`` (layer · 4 + group) on, with the residual of each group from the CPU
    actors behind ``count`` lanes (``protocol.lane``, addresses at ``lanes_at``): for each ``chunk`` rows of
    the pass in turn (a request carries at most that many), one lane per actor in row order. Each chunk's x'
    is posted to its lanes, the base product runs meanwhile (and the rows the engine keeps, where
    ``held_at`` is a table of their ``ResidualMatrix.fields`` addresses per step, 0 where none: ``held``),
    then each reply is added into Y at its rows and columns.

    Returns the step it reached: all of them, or the one whose reply is not in (or not a plain result) or
    whose post failed, for Python to settle; called again from there with ``resumed``, it takes up that group
    after its wait. With ``attend_elsewhere`` (more rows than ``attend``'s loops take: sdpa's) it returns
    -1 - layer after each layer's qkv group, for Python to attend and set the o group's input; it is then
    called again from that layer's o group. The time of each part adds into the float64 ``times`` at
    ``times_at``."""
    c = _context(ctx_at)
    lanes = numba.carray(I64_PTR(lanes_at), count)
    times = numba.carray(F64_PTR(times_at), TIMES)
    clock = lanes[0]
    while step < 4 * c[LAYERS]:
        layer, g = step // 4, step % 4
        if not resumed:
            t0 = lane.now_ns(clock)
            if _post(c, lanes, count, chunk, layer, g):
                return step
            t1 = lane.now_ns(clock)
            base(ctx_at, layer, g)
            t2 = lane.now_ns(clock)
            times[SUBMIT_S] += (t1 - t0) * 1e-9
            times[BASE_S] += (t2 - t1) * 1e-9
            fields = numba.carray(I64_PTR(held_at), 4 * c[LAYERS])[step] if held_at else 0
            if fields:
                held(ctx_at, layer, g, fields, levels)
                t3 = lane.now_ns(clock)
                times[HELD_S] += (t3 - t2) * 1e-9
                t2 = t3
            answered = _answered(lanes, count)
            times[WAIT_S] += (lane.now_ns(clock) - t2) * 1e-9
            if not answered:
                return step
        resumed = False
        attended = _finish_group(ctx_at, c, lanes, count, chunk, layer, g, times, clock, attend_elsewhere)
        step += 1
        if not attended:
            return -1 - layer
    return step


# A part's row in ``parts_layers``'s table: its context, its lanes' table and their count.
PART_CONTEXT, PART_LANES, PART_LANE_COUNT = range(3)
PART = 3


@njit(inline="always", cache=True)
def part_op(op, parts):
    """(part, step, whether it posts) of op ``op`` of ``parts_layers``: first each part's post of step 0, then
    for each step and part in turn the finish of that step and the post of the next."""
    if op < parts:
        return op, 0, True
    k = op - parts
    s, r = k // (2 * parts), k % (2 * parts)
    return r // 2, s + r % 2, r % 2 == 1


@njit(cache=True)
def parts_ops(parts, layers):
    """How many ops ``parts_layers`` runs for ``parts`` parts of a pass through ``layers`` layers (the posts of
    the step past the last are no ops, counted all the same)."""
    return parts + 2 * parts * 4 * layers


@njit(cache=True)
def parts_layers(parts_at, parts, chunk, op, times_at, attend_elsewhere):
    """The verifier's layers for one sequence's pass cut into ``parts`` parts of its rows in order, each with
    its own context and lanes (a table of ``PART`` int64 a part at ``parts_at``), as a wavefront: the base
    product of one part and its finishing work (rotations, norms, attention) run while the CPU actors
    multiply the residual of the parts posted before it, where one pass would leave them idle through all
    of the finishing work. A part's attention at a layer needs the K/V of the parts before it at that layer,
    which their finishes of the qkv group wrote first.

    Runs the ops (``part_op``) from ``op`` on and returns the one it reached: all of them (``parts_ops``); an
    op whose post failed or whose replies are not in (or not plain results), for Python to wait on that
    part's lanes and call again from there; or, with ``attend_elsewhere``, -1 - op after a part's qkv group
    is finished, for Python to attend that part's rows, set its o group's input and call again from op + 1.
    The time of each part adds into the float64 ``times`` at ``times_at``, as ``verify_layers``'s."""
    table = numba.carray(I64_PTR(parts_at), (parts, PART))
    times = numba.carray(F64_PTR(times_at), TIMES)
    layers = _context(table[0, PART_CONTEXT])[LAYERS]
    steps, ops = 4 * layers, parts_ops(parts, layers)
    clock = numba.carray(I64_PTR(table[0, PART_LANES]), 1)[0]
    while op < ops:
        p, step, posts = part_op(op, parts)
        ctx_at, count = table[p, PART_CONTEXT], table[p, PART_LANE_COUNT]
        c = _context(ctx_at)
        lanes = numba.carray(I64_PTR(table[p, PART_LANES]), count)
        layer, g = step // 4, step % 4
        t0 = lane.now_ns(clock)
        if posts:
            if step < steps:
                if _post(c, lanes, count, chunk, layer, g):
                    return op
                t1 = lane.now_ns(clock)
                base(ctx_at, layer, g)
                times[SUBMIT_S] += (t1 - t0) * 1e-9
                times[BASE_S] += (lane.now_ns(clock) - t1) * 1e-9
        else:
            answered = _answered(lanes, count)
            times[WAIT_S] += (lane.now_ns(clock) - t0) * 1e-9
            if not answered:
                return op
            if not _finish_group(ctx_at, c, lanes, count, chunk, layer, g, times, clock, attend_elsewhere):
                return -1 - op
        op += 1
    return op


@dataclass(frozen=True)
class Sequence:
    """One sequence's part of a pass: its caches [layers, slots, kv, head_dim] (fp32) with ``start`` slots
    before its n new rows, ``masks`` bool [2, n, start + n] and ``cos``/``sin`` fp32 [2, n, head_dim] per
    RoPE kind (full, sliding), all contiguous; ``q_factor`` each row's factor on q beside the attention
    scale (Ministral 3's by position)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    start: int
    masks: np.ndarray
    cos: np.ndarray
    sin: np.ndarray
    q_factor: np.ndarray | None = None  # fp32 [n]: each row's factor on q (Ministral 3), None: 1


class CompiledLayers:
    """A model's decoder layers as this module runs them: its table, its fixed facts, the buffers a pass
    works in and, per token count, a context and views of them (kept, so that a step allocates nothing).
    ``bind`` fills a pass's context; the model then calls ``draft_layers`` (the draft), ``begin`` and
    ``verify_layers`` (the verifier with leased slots), or drives ``begin``, ``base``, ``finish`` and
    ``attend`` with the residual between them."""

    def __init__(
        self, table: np.ndarray, eps_legs: np.ndarray, heads: int, kv_heads: int, head_dim: int, scale: float,
        eps: float, gelu: bool, softcap: float = 0.0, rope_order: np.ndarray | None = None, center: bool = False,
        parallel: bool = False,
    ) -> None:  # fmt: skip
        self.table, self.eps_legs = table, eps_legs
        self.d_in = [int(table[0, g * GROUP + WORDS]) * CODE_WORD for g in range(4)]
        self.rows = [int(table[0, g * GROUP + ROWS]) for g in range(4)]
        fixed = {TABLE: table.ctypes.data, EPS_LEGS: eps_legs.ctypes.data, LAYERS: len(table), HIDDEN: self.rows[O]}
        fixed |= {HEADS: heads, KV_HEADS: kv_heads, HEAD_DIM: head_dim, GELU: int(gelu)}
        fixed |= {SCALE: _bits(scale), EPS: _bits(eps), SOFTCAP: _bits(softcap), CENTER: int(center)}
        fixed[PARALLEL] = int(parallel)
        self._rope_order = rope_order  # kept alive: the context holds its address (0: none)
        fixed[ROPE_ORDER] = 0 if rope_order is None else rope_order.ctypes.data
        self._fixed = fixed
        self._sets: list[_Buffers] = []
        self._bound: dict[int, tuple] = {}

    @staticmethod
    def takes(table: np.ndarray, heads: int, kv_heads: int, head_dim: int) -> bool:
        """Whether every layer has one shape, its groups chain as ``finish`` and ``attend`` assume, and a head
        is a whole number of 8-lane vectors."""
        d_in = table[:, [g * GROUP + WORDS for g in range(4)]] * CODE_WORD
        rows = table[:, [g * GROUP + ROWS for g in range(4)]]
        if (d_in != d_in[0]).any() or (rows != rows[0]).any() or heads % kv_heads or head_dim % 8:
            return False
        (di, r) = d_in[0], rows[0]
        hidden = r[O]
        return bool(
            r[QKV] == (heads + 2 * kv_heads) * head_dim
            and di[O] == heads * head_dim
            and di[QKV] == di[GATE_UP] == r[DOWN] == hidden
            and r[GATE_UP] == 2 * di[DOWN]
        )

    def _for(self, n: int, part: int = 0) -> _Views:
        """n tokens' context and views of a part's buffers: one set a part of a pass (``parts_layers``), sized
        for the most tokens asked so far (a prompt's hundreds as a decode step's few), so that a pass
        allocates nothing once warm."""
        while len(self._sets) <= part:
            self._sets.append(_Buffers())
        buffers = self._sets[part]
        if n > buffers.capacity:
            widths = (max(self.d_in), max(self.rows), max(self.rows), self.d_in[O], self.d_in[DOWN])
            buffers.arrays = [np.empty(n * w, np.float32) for w in widths]
            buffers.capacity, buffers.views = n, {}
        if n not in buffers.views:
            ctx = np.zeros(CONTEXT, np.int64)
            for field, value in self._fixed.items():
                ctx[field] = value
            for field, buffer in zip((X, Y, Z, ATTN, ACT), buffers.arrays, strict=True):
                ctx[field] = buffer.ctypes.data
            ctx[TOKENS] = n
            x, y, z, attn, _ = buffers.arrays

            def view(array: np.ndarray, width: int) -> torch.Tensor:
                return torch.from_numpy(array[: n * width]).view(n, width)

            buffers.views[n] = _Views(
                ctx, [view(x, d) for d in self.d_in], [view(y, r) for r in self.rows], view(z, self.rows[QKV]),
                view(attn, self.d_in[O]),
            )  # fmt: skip
        return buffers.views[n]

    def bind(
        self, h: torch.Tensor, sequences: list[Sequence], threads: int, part: int = 0,
        share_from: list[int] | None = None, chunk: int = 0,
    ) -> int:  # fmt: skip
        """The context of one pass (or of part ``part`` of one: ``parts_layers``) over h [rows, hidden] (fp32,
        contiguous, updated in place), the ``sequences``' rows in order; ``share_from``: each group's first code
        word of the base that the CPU actors multiply in requests of ``BASE_SHARE_TOKENS`` rows or more
        (None: none), the pass's rows going in requests of ``chunk``. Its address, for the calls."""
        ctx = self._for(h.shape[0], part).ctx
        ctx[SHARE_FROM : SHARE_FROM + 4] = [d // CODE_WORD for d in self.d_in] if share_from is None else share_from
        ctx[CHUNK] = chunk
        table = np.empty((len(sequences), SEQUENCE), np.int64)
        first = 0
        for row, q in zip(table, sequences, strict=True):
            n = q.cos.shape[1]
            factor_at = 0 if q.q_factor is None else q.q_factor.ctypes.data
            row[:] = (first, n, q.k_cache.data_ptr(), q.v_cache.data_ptr(), q.k_cache.shape[1], q.start,
                      q.masks.ctypes.data, q.cos.ctypes.data, q.sin.ctypes.data, factor_at)  # fmt: skip
            first += n
        if first != h.shape[0]:
            raise ValueError(f"the sequences hold {first} rows, the hidden states {h.shape[0]}")
        ctx[H], ctx[THREADS], ctx[TABLES] = h.data_ptr(), threads, table_scratch(threads)
        ctx[SEQUENCES], ctx[SEQUENCE_TABLE] = len(sequences), table.ctypes.data
        self._bound[part] = (h, table, sequences)  # alive while the context points at them
        return ctx.ctypes.data

    def x_rot(self, n: int, g: int, part: int = 0) -> torch.Tensor:
        """The context's x' of group ``g`` as a tensor [n, d_in] (a view: valid until the next ``finish``)."""
        return self._sets[part].views[n].x_rot[g]

    def y(self, n: int, g: int, part: int = 0) -> torch.Tensor:
        """The context's base product Y of group ``g`` [n, rows], a view: the residual's rows are added into
        it before ``finish``."""
        return self._sets[part].views[n].y[g]

    def qkv(self, n: int, part: int = 0) -> torch.Tensor:
        """The qkv group's output Z [n, rows] after ``finish``, a view."""
        return self._sets[part].views[n].qkv

    def attn(self, n: int, part: int = 0) -> torch.Tensor:
        """The context's attention output ATTN [n, heads·head_dim], a view, which ``o_input`` reads."""
        return self._sets[part].views[n].attn


@dataclass
class _Buffers:
    """One part's pass buffers (X, Y, Z, ATTN, ACT) for up to ``capacity`` tokens, and per token count its
    context and views of them."""

    arrays: list[np.ndarray] = field(default_factory=list)
    capacity: int = 0
    views: dict[int, _Views] = field(default_factory=dict)


@dataclass(frozen=True)
class _Views:
    """One token count's context and tensor views of the pass buffers it points at."""

    ctx: np.ndarray
    x_rot: list[torch.Tensor]
    y: list[torch.Tensor]
    qkv: torch.Tensor
    attn: torch.Tensor


def _bits(value: float) -> int:
    return int(np.float64(value).view(np.int64))
