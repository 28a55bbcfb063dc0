"""The project's one 64-bit mixer: splitmix64's finaliser, a bijection on uint64 with full
avalanche. Data readers hash categorical strings with it, the embedding engine derives index
slots, shards and initial values from it, and benchmarks spread Zipf ranks over uint64 with it.
Kept here, apart from both, so that neither the data layer nor the benchmarks import the engine."""
import numpy as np
from numba import njit

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


@njit(inline="always", cache=True)  # cached: Python code calls it too (seeds, salts), not only kernels
def mix64(x):
    """splitmix64 finaliser of uint64 x (any integer is taken as its uint64 bits)."""
    x = np.uint64(x)
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


@njit(cache=True, nogil=True)
def mix64_array(values, out):
    """out[i] = mix64(values[i]) for uint64 arrays of equal length."""
    for i in range(values.shape[0]):
        out[i] = mix64(values[i])
