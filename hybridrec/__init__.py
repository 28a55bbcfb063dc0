"""hybridrec: training recommendation models whose embedding tables outgrow one machine."""
from hybridrec.kernel_cache import configure as _configure_kernel_cache

__version__ = "0.1.0"
_configure_kernel_cache()  # before any module compiles a cached kernel
