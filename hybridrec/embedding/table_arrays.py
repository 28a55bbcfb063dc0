"""Many tables' arrays handed to one numba kernel as a single int64 table of addresses and shapes.

The collection's group kernels serve every table of a batch in one call. Passed as numba typed
lists (one item per table), each kind of array would be typed and unboxed through Python by the
dispatcher on every call. One int64 array of addresses takes the dispatcher's fast path, and the
kernel views each address as an array again (`rows_of`, `meta_of`, ...), which costs nothing.

Whoever builds the address table must keep the arrays alive for as long as it is used:
`TableArrays` holds them.
"""
import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic

from .kernels import META_WIDTH, PARTS_WIDTH, SCALARS_WIDTH

# columns of the address table: one row per table
TA_ROWS, TA_META, TA_INDEX, TA_PARTS, TA_SKETCH, TA_SCALARS = 0, 1, 2, 3, 4, 5  # addresses
TA_CAPACITY, TA_WIDTH, TA_SLOTS, TA_NPARTS, TA_SKETCH_WIDTH = 6, 7, 8, 9, 10  # shapes
TA_LOG, TA_LOG_SLOTS = 11, 12  # the LRU ring: address, entries
TA_COLUMNS = 13


@intrinsic
def _pointer(typingctx, address, dtype):
    """A typed pointer to memory at an integer address."""
    if not isinstance(address, types.Integer) or not isinstance(dtype, types.NumberClass):
        return None
    pointer_type = types.CPointer(dtype.instance_type)
    sig = pointer_type(address, dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer_type))

    return sig, codegen


@njit(inline="always")
def rows_of(tables, t):
    """Table t's rows: float32 [capacity, width]."""
    return carray(_pointer(tables[t, TA_ROWS], np.float32), (tables[t, TA_CAPACITY], tables[t, TA_WIDTH]))


@njit(inline="always")
def meta_of(tables, t):
    """Table t's metadata records: int32 [capacity, META_WIDTH]."""
    return carray(_pointer(tables[t, TA_META], np.int32), (tables[t, TA_CAPACITY], META_WIDTH))


@njit(inline="always")
def meta64_of(tables, t):
    """The same metadata as uint64 [capacity, META_WIDTH // 2] (column 0: the row's key)."""
    return carray(_pointer(tables[t, TA_META], np.uint64), (tables[t, TA_CAPACITY], META_WIDTH // 2))


@njit(inline="always")
def index_of(tables, t):
    return carray(_pointer(tables[t, TA_INDEX], np.int32), (tables[t, TA_SLOTS],))


@njit(inline="always")
def parts_of(tables, t):
    return carray(_pointer(tables[t, TA_PARTS], np.int64), (tables[t, TA_NPARTS], PARTS_WIDTH))


@njit(inline="always")
def sketch_of(tables, t):
    return carray(_pointer(tables[t, TA_SKETCH], np.uint16), (2, tables[t, TA_SKETCH_WIDTH]))


@njit(inline="always")
def lru_log_of(tables, t):
    """Table t's LRU ring (kernels.py): int32 [2 * capacity + partitions]."""
    return carray(_pointer(tables[t, TA_LOG], np.int32), (tables[t, TA_LOG_SLOTS],))


@njit(inline="always")
def scalars_of(tables, t):
    return carray(_pointer(tables[t, TA_SCALARS], np.int64), (SCALARS_WIDTH,))


class TableArrays:
    """The address table of some stores' arrays, and references that keep those arrays alive.
    A store keeps its arrays for life (its index grows inside a full-size array), so the table
    is made once per set of stores."""

    def __init__(self, stores):
        self._arrays = []
        self.table = np.empty((len(stores), TA_COLUMNS), np.int64)
        for t, s in enumerate(stores):
            arrays = {TA_ROWS: (s.rows, np.float32, 2), TA_META: (s.meta, np.int32, 2),
                      TA_INDEX: (s.index, np.int32, 1), TA_PARTS: (s.parts, np.int64, 2),
                      TA_SKETCH: (s.sketch, np.uint16, 2), TA_SCALARS: (s.scalars, np.int64, 1),
                      TA_LOG: (s.lru_log, np.int32, 1)}
            for column, (arr, dtype, ndim) in arrays.items():
                if arr.dtype != dtype or arr.ndim != ndim or not arr.flags.c_contiguous:
                    raise TypeError(f"store {t}: array {column} is {arr.dtype} {arr.shape}, not a C-contiguous "
                                    f"{ndim}-d {np.dtype(dtype)} array (a bug in hybridrec)")
                self.table[t, column] = arr.ctypes.data
                self._arrays.append(arr)
            if s.meta.shape != (s.rows.shape[0], META_WIDTH) or s.parts.shape[1] != PARTS_WIDTH \
                    or s.sketch.shape[0] != 2 or s.scalars.shape[0] != SCALARS_WIDTH:
                raise TypeError(f"store {t}: array shapes do not match the kernels' layout (a bug in hybridrec)")
            self.table[t, TA_CAPACITY], self.table[t, TA_WIDTH] = s.rows.shape
            self.table[t, TA_SLOTS] = s.index.shape[0]
            self.table[t, TA_NPARTS] = s.parts.shape[0]
            self.table[t, TA_SKETCH_WIDTH] = s.sketch.shape[1]
            self.table[t, TA_LOG_SLOTS] = s.lru_log.shape[0]
