"""The embedding engine: one store, its kernels, and the torch module on top."""
from .collection import EmbeddingCollection
from .hashing import route
from .memory import unlink_shared
from .optim import OptimizerConfig
from .store import EmbeddingStore, Lookup
from .table import TableConfig

__all__ = ["EmbeddingCollection", "EmbeddingStore", "Lookup", "OptimizerConfig", "TableConfig", "route", "unlink_shared"]
