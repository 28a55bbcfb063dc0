"""The embedding engine: one store, its kernels, its checkpoints, the first-seen dedupe, and the
torch module on top."""
from .collection import EmbeddingCollection
from .dedupe import first_seen_unique
from .hashing import route
from .memory import unlink_shared
from .optim import OptimizerConfig
from .store import EmbeddingStore, Lookup
from .table import TableConfig

__all__ = ["EmbeddingCollection", "EmbeddingStore", "Lookup", "OptimizerConfig", "TableConfig", "first_seen_unique",
           "route", "unlink_shared"]
