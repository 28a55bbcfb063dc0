"""A CPU cache prefetch usable inside numba kernels.

Probing a big hash table is a chain of dependent cache misses (index slot, then the row's key).
Kernels issue `prefetch_row(array, i)` for the rows they will touch a few keys ahead, so those
misses overlap instead of following one another. It compiles to LLVM's `llvm.prefetch`, a hint
that never faults, so a stale or out-of-range guess costs nothing but the hint.
"""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _emit_prefetch(context, builder, arrty, array, indices):
    arr = context.make_array(arrty)(context, builder, array)
    ptr = cgutils.get_item_pointer(context, builder, arrty, arr, indices, wraparound=False)
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    # read access, high temporal locality, data cache
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
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


@intrinsic
def prefetch_cell(typingctx, array, row, col):
    """Hint that array[row, col] of a 2-d array will be read soon (e.g. a row's second cache line)."""
    if not (isinstance(array, types.Array) and array.ndim == 2 and isinstance(row, types.Integer)
            and isinstance(col, types.Integer)):
        return None
    sig = types.void(array, row, col)

    def codegen(context, builder, signature, args):
        idx = [context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 2)]
        return _emit_prefetch(context, builder, signature.args[0], args[0], idx)

    return sig, codegen
