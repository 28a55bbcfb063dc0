"""CPU cache hints usable inside numba kernels: prefetches and non-temporal stores.

Probing a big hash table is a chain of dependent cache misses (index slot, then the row's key).
Kernels issue `prefetch_row(array, i)` for the rows they will touch a few keys ahead, so those
misses overlap instead of following one another. It compiles to LLVM's `llvm.prefetch`, a hint
that never faults, so a stale or out-of-range guess costs nothing but the hint.

Pooling writes each 64-byte output row once and never reads it back: an ordinary store first
reads the line from memory (read-for-ownership) and stalls the store queue on that miss.
`stream_line` writes a whole line with a non-temporal store instead, and `store_fence` orders
those stores before the kernel returns, so any thread that later reads the output sees them.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _emit_prefetch(context, builder, arrty, array, indices, for_write=False):
    arr = context.make_array(arrty)(context, builder, array)
    ptr = cgutils.get_item_pointer(context, builder, arrty, arr, indices, wraparound=False)
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    # read (or write) access, high temporal locality, data cache
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, int(for_write)), ir.Constant(i32, 3),
                      ir.Constant(i32, 1)])
    return context.get_dummy_value()


@intrinsic
def prefetch_row(typingctx, array, row):
    """Hint that array[row] (first element of that row, any ndim >= 1) will be read soon."""
    if not isinstance(array, types.Array) or not isinstance(row, types.Integer):
        return None
    sig = types.void(array, row)

    def codegen(context, builder, signature, args):
        arrty = signature.args[0]
        zero = context.get_constant(types.intp, 0)
        idx = [context.cast(builder, args[1], signature.args[1], types.intp)] + [zero] * (arrty.ndim - 1)
        return _emit_prefetch(context, builder, arrty, args[0], idx)

    return sig, codegen


def _cell_prefetch(array, row, col, for_write):
    """Signature and codegen of a prefetch of array[row, col] (array[row, col, 0] when deeper)."""
    if not (isinstance(array, types.Array) and array.ndim >= 2 and isinstance(row, types.Integer)
            and isinstance(col, types.Integer)):
        return None
    sig = types.void(array, row, col)

    def codegen(context, builder, signature, args):
        arrty = signature.args[0]
        zero = context.get_constant(types.intp, 0)
        idx = [context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 2)]
        return _emit_prefetch(context, builder, arrty, args[0], idx + [zero] * (arrty.ndim - 2), for_write)

    return sig, codegen


@intrinsic
def prefetch_cell(typingctx, array, row, col):
    """Hint that array[row, col] (of a 2-d array; array[row, col, 0] of a deeper one) will be read
    soon: a row's second cache line, or one cell of a [B, T, dim] gradient."""
    return _cell_prefetch(array, row, col, for_write=False)


@intrinsic
def prefetch_cell_for_write(typingctx, array, row, col):
    """Hint that array[row, col] will be written soon (`prefetchw` on x86): the line arrives owned,
    so the stores that initialise a new row find it ready instead of each waiting for it."""
    return _cell_prefetch(array, row, col, for_write=True)


CACHE_LINE = 64  # bytes in a CPU cache line (x86-64 and most arm64 cores)
LINE_FLOATS = CACHE_LINE // 4  # float32 values in a line


@intrinsic
def stream_line(typingctx, dst, b, col, src, src_row, line):
    """dst[b, col, 16*line : 16*line+16] = src[src_row, 16*line : 16*line+16] (float32; dst 3-d,
    src 2-d) as one non-temporal 64-byte store. The caller checks that dst[b, col] starts on a
    64-byte boundary and that both last dimensions are contiguous (`kernels._can_stream`)."""
    ok = (isinstance(dst, types.Array) and dst.ndim == 3 and dst.dtype == types.float32
          and isinstance(src, types.Array) and src.ndim == 2 and src.dtype == types.float32
          and all(isinstance(i, types.Integer) for i in (b, col, src_row, line)))
    if not ok:
        return None
    sig = types.void(dst, b, col, src, src_row, line)

    def codegen(context, builder, signature, args):
        d_ty, b_ty, c_ty, s_ty, r_ty, l_ty = signature.args
        offset = builder.mul(context.cast(builder, args[5], l_ty, types.intp),
                             context.get_constant(types.intp, LINE_FLOATS))
        d_arr = context.make_array(d_ty)(context, builder, args[0])
        s_arr = context.make_array(s_ty)(context, builder, args[3])
        d_idx = [context.cast(builder, args[1], b_ty, types.intp), context.cast(builder, args[2], c_ty, types.intp),
                 offset]
        s_idx = [context.cast(builder, args[4], r_ty, types.intp), offset]
        d_ptr = cgutils.get_item_pointer(context, builder, d_ty, d_arr, d_idx, wraparound=False)
        s_ptr = cgutils.get_item_pointer(context, builder, s_ty, s_arr, s_idx, wraparound=False)
        vector = ir.VectorType(ir.FloatType(), LINE_FLOATS)
        value = builder.load(builder.bitcast(s_ptr, vector.as_pointer()), align=4)
        store = builder.store(value, builder.bitcast(d_ptr, vector.as_pointer()), align=64)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def store_fence(typingctx):
    """Orders every earlier store, non-temporal ones included, before any later memory access
    (a sequentially consistent fence: `mfence` on x86, a full barrier elsewhere)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen
