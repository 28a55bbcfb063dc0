"""hybridrec.data: the Batch type, streaming readers (Criteo, Avazu, CSV/Parquet by schema),
synthetic data with a planted model, and the prefetching loader."""
from hybridrec.data.avazu import AvazuReader, avazu_schema
from hybridrec.data.batch import Batch, JaggedFeatures, rebatch
from hybridrec.data.criteo import CRITEO_SCHEMA, CriteoReader
from hybridrec.data.loader import PrefetchLoader, RowRange, split_first_rows, split_fraction
from hybridrec.data.synthetic import (CRITEO_LIKE, SyntheticConfig, SyntheticReader, criteo_like,
                                      planted_auc, planted_probabilities, write_synthetic)
from hybridrec.data.tabular import (BadRow, BadRows, DelimitedTextReader, ParquetReader,
                                    TabularSchema, tabular_reader)

__all__ = [
    "AvazuReader", "avazu_schema", "Batch", "JaggedFeatures", "rebatch", "CRITEO_SCHEMA",
    "CriteoReader", "PrefetchLoader", "RowRange", "split_first_rows", "split_fraction",
    "CRITEO_LIKE", "SyntheticConfig", "SyntheticReader", "criteo_like", "planted_auc",
    "planted_probabilities", "write_synthetic", "BadRow", "BadRows", "DelimitedTextReader",
    "ParquetReader", "TabularSchema", "tabular_reader",
]
