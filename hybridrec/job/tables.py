"""The embedding tables of a job, derived from its config alone (no data is read).

Every process of a job computes this independently and gets the same answer: PS servers host
the tables, embedding workers map features to tables and pool, trainers size the dense model
and, with the local placement, create the tables in process. The deep tables have the model's
embedding_dim; models with first-order terms (LR, FM, Wide&Deep, DeepFM) also get one dim-1
table per feature (named '<table>:wide'). `per_feature`, `shared` and `wide` sections change
only the settings they name; the rest come from `default`.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import cached_property

from hybridrec.config import ConfigError, JobConfig, TableSection
from hybridrec.data.batch import JaggedFeatures
from hybridrec.embedding import TableConfig
from hybridrec.job.sources import data_layout
from hybridrec.models import build_model, model_class
from hybridrec.models.custom import ModelInputs, build_custom_model, is_custom
from hybridrec.embedding.layout import BatchLayout, batch_layout


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
            tables[name] = settings.table_config(dim, seed_offset=1000 * len(tables) + (500 if wide else 0), name=name)
        mapping[feature] = name
    return tables, mapping


@dataclass(frozen=True)
class JobTables:
    """Tables and feature -> table maps of the deep (dim = embedding_dim) and wide (dim 1) sides."""

    sparse_names: list[str]
    num_dense: int
    label_names: list[str]
    deep: dict[str, TableConfig]
    deep_map: dict[str, str]
    wide: dict[str, TableConfig]
    wide_map: dict[str, str]

    @property
    def num_tasks(self) -> int:
        return len(self.label_names)

    def all_tables(self) -> dict[str, TableConfig]:
        """Every table the PS servers host (wide tables are named '<table>:wide')."""
        return {**self.deep, **self.wide}

    @property
    def deep_dim(self) -> int:
        """The deep side's embedding dimension (0 when the model has no deep side)."""
        return next((cfg.dim for cfg in self.deep.values()), 0)

    @cached_property
    def pooling(self) -> dict[str, str]:
        return {name: cfg.pooling for name, cfg in self.all_tables().items()}

    def layout(self, features: JaggedFeatures) -> BatchLayout:
        """Where a batch's IDs go, as the embedding worker and the NN workers both compute it."""
        return batch_layout(features, self.sparse_names, self.deep_map, self.wide_map, self.pooling)


def job_tables(cfg: JobConfig) -> JobTables:
    sparse_names, num_dense, label_names = data_layout(cfg.data)
    cls = model_class(cfg.model.name)
    deep, deep_map = (embedding_tables(cfg, sparse_names, cfg.model.embedding_dim, wide=False)
                      if cls.needs_deep else ({}, {}))
    wide, wide_map = embedding_tables(cfg, sparse_names, 1, wide=True) if cls.needs_wide else ({}, {})
    return JobTables(sparse_names, num_dense, label_names, deep, deep_map, wide, wide_map)


def model_inputs(cfg: JobConfig, tables: JobTables) -> ModelInputs:
    """What a model of the user's is told about its inputs (hybridrec.models.custom)."""
    return ModelInputs(tuple(tables.sparse_names), cfg.model.embedding_dim, tables.num_dense, tables.num_tasks)


def job_dense_model(cfg: JobConfig, tables: JobTables, module=None):
    """The job's dense model (on the CPU), sized by its tables: what trainers train and what PS
    servers check dense parameters against. `module`: the nn.Module a Python caller made itself
    (model.name `object`, hybridrec.api), wrapped as every custom model is."""
    m = cfg.model
    if module is not None or is_custom(m.name):
        return build_custom_model(m.name, model_inputs(cfg, tables), m.hparams, module)
    return build_model(m.name, num_sparse=len(tables.sparse_names), embedding_dim=m.embedding_dim,
                       num_dense=tables.num_dense, num_tasks=tables.num_tasks, **m.hparams)
