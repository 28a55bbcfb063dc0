"""hybridrec: training recommendation models whose embedding tables outgrow one machine."""
from hybridrec.kernel_cache import configure as _configure_kernel_cache
from hybridrec.thread_waits import configure as _configure_thread_waits

__version__ = "0.1.0"
_configure_kernel_cache()  # before any module compiles a cached kernel
_configure_thread_waits()  # before any module imports torch
