"""RecModel: a whole CTR model, embeddings plus dense part, built from a job config.

The embedding side comes from the strategy (local stores here; remote PS shards or
model-parallel shards in distributed strategies) as modules with `forward_stacked(features)`.
The deep embeddings have the model's embedding_dim per feature; models that need first-order
terms (LR, FM, Wide&Deep, DeepFM) also get one dim-1 table per feature.
"""
from __future__ import annotations

import difflib

import torch

from hybridrec.config import ConfigError, JobConfig, TableSection
from hybridrec.embedding import EmbeddingCollection
from hybridrec.models import build_model, model_class


def _settings(default: TableSection, section: TableSection | None) -> TableSection:
    """`default` with the fields that `section` sets explicitly (per-feature, shared and wide
    sections override the default table's settings; they do not start from scratch)."""
    if section is None or section is default:
        return default
    fields = default.model_dump()
    fields.update({k: getattr(section, k) for k in section.model_fields_set if k in TableSection.model_fields})
    fields["optimizer"] = _optimizer(default.optimizer, section.optimizer if "optimizer" in section.model_fields_set
                                     else None)
    return TableSection(**fields)


def _optimizer(default, section) -> dict:
    """A table's optimizer: `default` with the hyper-parameters `section` sets, or `section`
    alone when it names another optimizer."""
    if section is None:
        return default.as_dict()
    if "name" in section.model_fields_set and section.name != default.name:
        return section.as_dict()
    return {**default.as_dict(), **{k: v for k, v in section.as_dict().items() if k != "name"},
            "name": default.name}


def resolve_device(name: str) -> torch.device:
    """'auto' = CUDA when available, else CPU; asking for CUDA without it is an error."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device: 'cuda' was asked for but torch.cuda.is_available() is False; "
                         "use 'auto' or 'cpu'")
    return torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")


def embedding_tables(cfg: JobConfig, sparse_names: list[str], dim: int, wide: bool):
    """(tables, feature_to_table) for the deep (wide=False) or first-order (wide=True) side."""
    emb = cfg.embedding
    suffix = ":wide" if wide else ""
    tables, mapping = {}, {}
    shared_of = {f: name for name, t in emb.shared.items() for f in t.features}
    unknown = [f for f in list(shared_of) + list(emb.per_feature) if f not in sparse_names]
    if unknown:
        lower = {n.lower(): n for n in sparse_names}
        close = difflib.get_close_matches(unknown[0].lower(), list(lower), n=1)
        hint = f" (did you mean {lower[close[0]]!r}?)" if close else ""
        raise ConfigError(f"embedding.shared / embedding.per_feature: features {unknown} are not sparse features "
                          f"of the data{hint}; those are {sparse_names}")
    for feature in sparse_names:
        if feature in shared_of:
            name = shared_of[feature] + suffix
            section = emb.wide if wide else emb.shared[shared_of[feature]]
        else:
            name = feature + suffix
            section = emb.wide if wide else emb.per_feature.get(feature)
        if name not in tables:
            settings = _settings(emb.default, section)
            # each table gets its own seed so equal keys in different tables start differently
            tables[name] = settings.table_config(dim, seed_offset=1000 * len(tables) + (500 if wide else 0))
        mapping[feature] = name
    return tables, mapping


class RecModel(torch.nn.Module):
    """Embeddings and dense model; `forward(batch) -> logits [B, num_tasks]`."""

    def __init__(self, cfg: JobConfig, sparse_names: list[str], num_dense: int, num_tasks: int,
                 shm_prefix: str | None = None):
        super().__init__()
        m = cfg.model
        cls = model_class(m.name)
        self.sparse_names = list(sparse_names)
        self.dense_model = build_model(m.name, num_sparse=len(sparse_names), embedding_dim=m.embedding_dim,
                                       num_dense=num_dense, num_tasks=num_tasks, **m.hparams)
        self.deep = None
        self.wide = None
        if cls.needs_deep:
            tables, mapping = embedding_tables(cfg, sparse_names, m.embedding_dim, wide=False)
            self.deep = EmbeddingCollection(tables, mapping, shm_prefix=shm_prefix)
        if cls.needs_wide:
            tables, mapping = embedding_tables(cfg, sparse_names, 1, wide=True)
            self.wide = EmbeddingCollection(tables, mapping, shm_prefix=shm_prefix and shm_prefix + "-wide")

    @property
    def device(self) -> torch.device:
        """Where the dense part runs; embeddings stay in host memory and move per batch."""
        return next(self.dense_model.parameters(), torch.empty(0)).device

    def collections(self) -> dict:
        return {name: c for name, c in (("deep", self.deep), ("wide", self.wide)) if c is not None}

    def forward(self, batch) -> torch.Tensor:
        feats = batch.sparse
        device = self.device
        deep = self.deep.forward_stacked(feats, self.sparse_names).to(device) if self.deep is not None else None
        wide = (self.wide.forward_stacked(feats, self.sparse_names).squeeze(-1).to(device)
                if self.wide is not None else None)
        dense = torch.from_numpy(batch.dense).to(device) if batch.dense.shape[1] else None
        return self.dense_model(deep, wide, dense)
