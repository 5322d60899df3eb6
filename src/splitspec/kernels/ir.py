"""LLVM IR building blocks for the numba kernels, called at compile time from their intrinsics' codegen.

Both actors' CPU kernels (the residual product, the 2-bit base product) write their inner loops as IR
with explicit vectors; the pieces they share live here, so that a prefetch or a broadcast is spelled one
way and compiles to the same instructions in both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

I8, I16, I32, I64 = (ir.IntType(b) for b in (8, 16, 32, 64))
F32 = ir.FloatType()


def c64(value: int) -> ir.Constant:
    return ir.Constant(I64, value)


def literals(*values) -> bool:
    """Whether every typing argument is a literal: an intrinsic specialised on them refuses others."""
    return all(isinstance(v, types.IntegerLiteral | types.BooleanLiteral) for v in values)


def data(context, builder, array_type, array):
    """Pointer to the first element of an array."""
    return context.make_array(array_type)(context, builder, array).data


def element(context, builder, array_type, array, index):
    """Pointer to element ``index`` of a C-contiguous array (a flat index)."""
    return builder.gep(data(context, builder, array_type, array), [index])


def load(builder, ptr, ty, align: int):
    return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=align)


def store(builder, value, ptr, align: int) -> None:
    builder.store(value, builder.bitcast(ptr, value.type.as_pointer()), align=align)


def call(builder, name: str, ret, args: list):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def prefetch(builder, ptr, locality: int = 3) -> None:
    """Read prefetch into all cache levels (``locality`` 3: prefetcht0) or into L2 and out (2: prefetcht1);
    never faults, so running past an array's end is fine."""
    i32 = (ir.Constant(I32, v) for v in (0, locality, 1))  # read, which levels, data
    call(builder, "llvm.prefetch.p0", ir.VoidType(), [builder.bitcast(ptr, I8.as_pointer()), *i32])


def splat(builder, scalar, lanes: int = 8):
    """``lanes`` lanes of ``scalar`` (fp32 or int32); one lane is the scalar itself."""
    if lanes == 1:
        return scalar
    vector = ir.VectorType(scalar.type, lanes)
    lane0 = builder.insert_element(ir.Constant(vector, ir.Undefined), scalar, ir.Constant(I32, 0))
    mask = ir.Constant(ir.VectorType(I32, lanes), [0] * lanes)
    return builder.shuffle_vector(lane0, ir.Constant(vector, ir.Undefined), mask)


def loop(builder, start, stop, step: int, carried: list, body: Callable) -> tuple:
    """Emit ``for (i = start; i + step <= stop; i += step) carried = body(i, carried)``.

    ``carried`` values (the partial sums) live in phi nodes, i.e. registers. Returns the final
    ``i`` and ``carried``, for a remainder loop.
    """
    entry = builder.block
    head = builder.append_basic_block("cols.head")
    body_block = builder.append_basic_block("cols.body")
    done = builder.append_basic_block("cols.done")
    builder.branch(head)
    builder.position_at_end(head)
    i = builder.phi(I64)
    i.add_incoming(start, entry)
    phis = []
    for value in carried:
        phi = builder.phi(value.type)
        phi.add_incoming(value, entry)
        phis.append(phi)
    after = builder.add(i, c64(step))
    builder.cbranch(builder.icmp_unsigned("<=", after, stop), body_block, done)
    builder.position_at_end(body_block)
    new = body(i, phis)
    i.add_incoming(after, builder.block)
    for phi, value in zip(phis, new, strict=True):
        phi.add_incoming(value, builder.block)
    builder.branch(head)
    builder.position_at_end(done)
    return i, phis


def switch(builder, value, cases: Sequence[int], emit: Callable[[int], None]) -> None:
    """``emit(case)`` in a block of its own for each of ``cases``, entered where ``value`` equals it; any
    other value takes the last case. A table of specialisations instead of a ladder of ifs: each case
    compiles its own loop with the case as a constant."""
    done = builder.append_basic_block("switch.done")
    blocks = [builder.append_basic_block(f"switch.case{case}") for case in cases]
    table = builder.switch(value, blocks[-1])
    for case, block in zip(cases[:-1], blocks, strict=False):
        table.add_case(ir.Constant(value.type, case), block)
    for case, block in zip(cases, blocks, strict=True):
        builder.position_at_end(block)
        emit(case)
        builder.branch(done)
    builder.position_at_end(done)


def _prefetch_line(locality: int):
    def codegen(context, builder, sig, args):
        prefetch(builder, element(context, builder, sig.args[0], args[0], args[1]), locality)
        return context.get_dummy_value()

    return codegen


@intrinsic
def prefetch_at(typingctx, array, index):
    """Prefetch the cache line holding ``array[index]`` into L1 (an index past the end is fine)."""
    return types.void(array, index), _prefetch_line(3)


@intrinsic
def stack(typingctx, nbytes):
    """``nbytes`` (a literal) of 64-byte aligned stack memory (a cache line: what AMX's tile loads need
    to run at speed), for ``carray``: unlike a heap array, it costs nothing per call."""
    if not isinstance(nbytes, types.IntegerLiteral):
        return None

    def codegen(context, builder, sig, args):
        ptr = cgutils.alloca_once(builder, I8, size=nbytes.literal_value)
        ptr.align = 64
        return ptr

    return types.voidptr(nbytes), codegen


def _pointer_to(dtype):
    @intrinsic
    def pointer(typingctx, address):
        """The address (an int) as a typed pointer, for ``numba.carray``."""
        sig = types.CPointer(dtype)(types.intp)

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

        return sig, codegen

    return pointer


F32_PTR, U8_PTR, U16_PTR = (_pointer_to(t) for t in (types.float32, types.uint8, types.uint16))
I32_PTR, U32_PTR = (_pointer_to(t) for t in (types.int32, types.uint32))
I64_PTR, F64_PTR = (_pointer_to(t) for t in (types.int64, types.float64))


@intrinsic
def address(typingctx, array):
    """The address of an array's first element, as an int."""
    sig = types.intp(array)

    def codegen(context, builder, sig, args):
        return builder.ptrtoint(data(context, builder, sig.args[0], args[0]), I64)

    return sig, codegen


@intrinsic
def load_acquire(typingctx, address):
    """The int64 at ``address`` read with acquire order: a flag that another process publishes with a release
    store, read anew on every call (the compiler may neither cache it nor hoist it out of a wait loop), and
    what the publisher wrote before it visible after it."""
    sig = types.int64(types.int64)

    def codegen(context, builder, sig, args):
        return builder.load_atomic(builder.inttoptr(args[0], I64.as_pointer()), "acquire", 8)

    return sig, codegen


@intrinsic
def store_release(typingctx, address, value):
    """Write the int64 ``value`` at ``address`` with release order: every store before it is visible to a
    reader that sees this one (``load_acquire``), whatever the compiler or the core reorders."""
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, sig, args):
        builder.store_atomic(args[1], builder.inttoptr(args[0], I64.as_pointer()), "release", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def c_call(typingctx, function, *args):
    """Call the C function at the address ``function`` with integer arguments passed as int64 (pointers and
    ints alike); its result as int64, of which a C ``int`` is the low half (``np.int32(...)``). The address
    is an argument, not a constant, so that a caller stays in numba's on-disk cache (libc moves from one
    process to the next)."""
    if not all(isinstance(a, types.Integer) for a in (function, *args)):
        return None
    sig = types.int64(types.int64, types.StarArgTuple.from_types(args))

    def codegen(context, builder, sig, llargs):
        values = cgutils.unpack_tuple(builder, llargs[1], len(args))
        values = [context.cast(builder, v, t, types.int64) for v, t in zip(values, args, strict=True)]
        pointer = builder.inttoptr(llargs[0], ir.FunctionType(I64, [I64] * len(args)).as_pointer())
        return builder.call(pointer, values)

    return sig, codegen
