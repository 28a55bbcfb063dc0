"""The job configuration: one YAML file describes data, model, embedding tables, training and
strategy. It is validated completely at load time: unknown keys are refused with the closest
valid name, bad values with what is allowed, and each message names the YAML file and line.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator


from hybridrec.errors import UserError


class ConfigError(UserError):
    """A configuration that cannot run; the message lists every problem with its location."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ------------------------------------------------------------------------------------ data
class SyntheticData(_Section):
    """Criteo-like generated rows with a planted logistic model (see hybridrec.data.synthetic)."""

    n_categorical: int = Field(26, ge=0)
    n_dense: int = Field(13, ge=0)
    n_multi_hot: int = Field(0, ge=0)
    multi_hot_max_length: int = Field(5, ge=1)
    vocab_size: int = Field(100_000, ge=1, le=2**32)
    zipf_exponent: float = Field(1.05, gt=0)
    id_weight_std: float = Field(0.2, ge=0)
    dense_weight_std: float = Field(0.3, ge=0)
    bias: float = -1.5
    train_rows: int = Field(200_000, ge=1)
    test_rows: int = Field(50_000, ge=1)


class _SchemaBase(_Section):
    def to_schema(self):
        from hybridrec.data.tabular import TabularSchema

        return TabularSchema(**self.model_dump())

    @model_validator(mode="after")
    def _check(self):
        try:
            self.to_schema()
        except (TypeError, ValueError) as exc:
            key = re.match(r"(\w+) ", str(exc))  # the schema's messages start with the key at fault
            raise ValueError(f"data.schema.{exc}" if key and key.group(1) in type(self).model_fields
                             else str(exc)) from None
        return self


def _schema_section() -> type[BaseModel]:
    """data.schema as a validated section whose keys, types and defaults are the fields of
    hybridrec.data.TabularSchema (one place writes them down); the schema's own checks (repeated
    columns, header without column_names, ...) run on the whole section."""
    from hybridrec.data.tabular import TabularSchema

    hints = typing.get_type_hints(TabularSchema)
    fields = {f.name: (hints[f.name], ... if f.default is dataclasses.MISSING else f.default)
              for f in dataclasses.fields(TabularSchema)}
    return create_model("SchemaSection", __base__=_SchemaBase, __doc__=TabularSchema.__doc__, **fields)


SchemaSection = _schema_section()


class DataConfig(_Section):
    format: Literal["synthetic", "criteo", "avazu", "tabular"] = "synthetic"
    synthetic: SyntheticData = SyntheticData()
    path: Optional[Union[str, list[str]]] = Field(None, description="train file(s); test rows come from the split")
    test_path: Optional[Union[str, list[str]]] = None
    train_rows: Optional[int] = Field(None, ge=1, description="the first N data lines (bad ones included) train, "
                                      "the rest test")
    test_fraction: Optional[float] = Field(None, gt=0, lt=1, description="the last fraction of rows is the test set")
    valid_path: Optional[Union[str, list[str]]] = Field(None, description="validation file(s), evaluated at "
                                                        "train.eval_every")
    valid_fraction: Optional[float] = Field(None, gt=0, lt=1, description="the last fraction of the training "
                                            "rows is the validation set")
    shuffle_buffer: int = Field(0, ge=0, description="training rows mixed by the shuffle buffer; 0 = file order")
    schema_: Optional[SchemaSection] = Field(None, alias="schema")
    stream: Optional[dict[str, Any]] = Field(None, description="train on a stream without end: {backend: files | "
                                             "redis, ...} (hybridrec.data.stream); held-out rows from test_path")
    batch_size: int = Field(4096, ge=1, le=1 << 24)
    eval_batch_size: Optional[int] = Field(None, ge=1)
    strict: bool = False
    prefetch: int = Field(4, ge=0, le=64)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("stream")
    @classmethod
    def _stream(cls, value):
        if value is not None:
            from hybridrec.data.stream import parse_stream_options

            parse_stream_options(value)
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if self.stream is not None:
            return self._stream_consistent()
        if self.format != "synthetic" and self.path is None:
            raise ValueError(f"data.path is required for format {self.format!r}")
        if self.format == "tabular" and self.schema_ is None:
            raise ValueError("data.schema is required for format 'tabular' (labels, dense, categorical, ...)")
        if self.schema_ is not None and not self.schema.sparse_feature_names:
            raise ValueError("data.schema: name at least one sparse column (categorical, multi_categorical or "
                             "hour_columns); every model embeds sparse features")
        if self.format != "tabular" and self.schema_ is not None:
            raise ValueError(f"data.schema describes the columns of format 'tabular'; format {self.format!r} has "
                             f"its own: remove data.schema or set data.format: tabular")
        if self.format != "synthetic" and self.test_path is None and self.train_rows is None and self.test_fraction is None:
            raise ValueError("say where test rows come from: data.test_path, data.train_rows or data.test_fraction")
        if self.train_rows is not None and self.test_fraction is not None:
            raise ValueError("data.train_rows and data.test_fraction exclude each other")
        for split in ("train_rows", "test_fraction"):
            if self.test_path is not None and getattr(self, split) is not None:
                raise ValueError(f"data.test_path and data.{split} exclude each other: with a test file every row "
                                 f"of data.path trains; remove one of them")
        if self.valid_path is not None and self.valid_fraction is not None:
            raise ValueError("data.valid_path and data.valid_fraction exclude each other")
        if self.format == "synthetic" and self.valid_path is not None:
            raise ValueError("data.valid_path is for file formats; synthetic data takes data.valid_fraction")
        return self

    def _stream_consistent(self):
        """A stream's records are lines or fields of a file format; its training rows have no
        end, so held-out rows come from files and nothing splits or shuffles the stream."""
        if self.format == "synthetic":
            raise ValueError("data.stream: records of a stream are parsed as data.format criteo, avazu or tabular, "
                             "not synthetic (`hybridrec data stream --synthetic N` writes synthetic rows as Criteo "
                             "lines: use format criteo)")
        if self.format == "tabular" and self.schema_ is None:
            raise ValueError("data.schema is required for format 'tabular' (labels, dense, categorical, ...)")
        for key in ("path", "train_rows", "test_fraction", "valid_fraction"):
            if getattr(self, key) is not None:
                raise ValueError(f"data.{key} does not go with data.stream: the stream is the training data and "
                                 f"has no end to split; give held-out rows as data.test_path (and data.valid_path)")
        if self.shuffle_buffer:
            raise ValueError("data.shuffle_buffer does not go with data.stream: a stream trains in arrival order "
                             "(its position in checkpoints is a place in that order)")
        return self

    @property
    def schema(self):
        """The hybridrec.data.TabularSchema of format 'tabular' (None for the other formats)."""
        return None if self.schema_ is None else self.schema_.to_schema()


# ------------------------------------------------------------------------------------ model
class ModelConfig(_Section):
    name: str = Field("deepfm", description="a built-in model (lr, fm, wide_deep, deepfm, dcn, dlrm; `hybridrec "
                      "models` lists them) or an import path 'package.module:Factory' / 'path/to/file.py:Factory' "
                      "of a model of your own (hybridrec.models.custom, docs/python-api.md)")
    embedding_dim: int = Field(16, ge=1, le=4096)
    hparams: dict[str, Any] = Field(default_factory=dict)
    loss: str = Field("bce", description="the training loss: bce (binary cross-entropy on the logits) or an import "
                      "path to loss(logits, labels) -> scalar (object: a loss given to hybridrec.api in Python)")

    @field_validator("name")
    @classmethod
    def _known_name(cls, name):
        from hybridrec.models import MODELS
        from hybridrec.models.custom import OBJECT, is_import_path, resolve

        if is_import_path(name):
            resolve(name)  # imports now: a path that does not import is refused at load time
        elif name not in MODELS and name != OBJECT:
            raise ValueError(f"unknown model {name!r}{_hint(name, MODELS)}; allowed: {sorted(MODELS)} or an import "
                             f"path 'package.module:Factory' to a model of your own")
        return name

    @field_validator("hparams")
    @classmethod
    def _known_hparams(cls, hparams, info):
        from hybridrec.models import model_hparams

        name = info.data.get("name")
        if name is None:  # the name itself is wrong; that error is reported
            return hparams
        allowed = model_hparams(name)
        if allowed is None:  # a factory of the user's that takes **kwargs
            return hparams
        for key in hparams:
            if key not in allowed:
                raise ValueError(f"{key!r} is not a hyper-parameter of model {name!r}"
                                 f"{_hint(key, allowed)}; allowed: {sorted(allowed) or 'none'}")
        return hparams

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, loss):
        from hybridrec.models.custom import BCE, OBJECT, resolve_loss

        if loss not in (BCE, OBJECT):
            resolve_loss(loss)  # refused at load time unless it imports and is callable
        return loss


# ------------------------------------------------------------------------------------ embeddings
class OptimizerSection(_Section):
    """A sparse optimizer: name plus its hyper-parameters (checked by OptimizerConfig)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: Literal["sgd", "adagrad", "adam", "ftrl"] = "adagrad"
    lr: Optional[float] = Field(None, gt=0)

    @model_validator(mode="after")
    def _check(self):
        from hybridrec.embedding import OptimizerConfig

        OptimizerConfig.parse(self.as_dict())
        return self

    def as_dict(self) -> dict:
        d = {"name": self.name, **(self.model_extra or {})}
        if self.lr is not None:
            d["lr"] = self.lr
        return d


class TierSection(_Section):
    """A disk tier under the tables' memory (hybridrec/embedding/disk_tier.py)."""

    path: str = Field(min_length=1, description="directory of the tier; each table gets its own directory in it")
    capacity_rows: int = Field(ge=1, le=2**40, description="rows the tier of one table may hold on disk")


class TableSection(_Section):
    """Settings of embedding tables; every field of hybridrec.embedding.TableConfig but dim."""

    capacity: int = Field(1_000_000, ge=1, le=2**31 - 2)
    optimizer: OptimizerSection = OptimizerSection(name="adagrad", lr=0.05)
    init: Union[str, dict[str, Any]] = "uniform"
    seed: int = Field(0, ge=0)
    eviction: Literal["lru", "lfu"] = "lru"
    admit_probability: float = Field(1.0, gt=0, le=1)
    admit_min_frequency: int = Field(1, ge=1, le=65535)
    weight_bound: Optional[float] = Field(None, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    pooling: Literal["sum", "mean", "sqrtn"] = "sum"
    num_threads: int = Field(1, ge=1, le=256)
    prefault: bool = False
    expire_after: Optional[dict[str, Union[int, float]]] = Field(
        None, description="{steps: N} or {seconds: S}: drop a row training has not used for longer (a stream's "
                          "features come and go); checked every 1/64 of the bound")

    tier: Optional[TierSection] = Field(None, description="{path, capacity_rows}: rows evicted from memory are "
                                        "kept on disk with their optimizer state and come back at their next pull")

    @field_validator("expire_after")
    @classmethod
    def _expire_after(cls, v):
        from hybridrec.embedding.table import parse_expire_after

        return parse_expire_after(v)

    @field_validator("init")
    @classmethod
    def _init(cls, v):
        from hybridrec.embedding.table import parse_init

        parse_init(v)
        return v

    def table_config(self, dim: int, seed_offset: int = 0, name: str | None = None):
        """The TableConfig of table `name`: its disk tier, if any, in `<tier.path>/<name>`."""
        from hybridrec.embedding import TableConfig
        from hybridrec.embedding.disk_tier import table_tier_path

        d = self.model_dump()
        d["optimizer"] = self.optimizer.as_dict()
        d["seed"] = self.seed + seed_offset
        if self.tier is not None:
            d["tier"] = {"path": table_tier_path(self.tier.path, name or "table"), "capacity_rows": self.tier.capacity_rows}
        return TableConfig(dim=dim, **d)


class SharedTable(TableSection):
    features: list[str] = Field(min_length=1, description="sparse features that share this table")


class EmbeddingSection(_Section):
    """Embedding tables: `default` settings for every table; `wide`, `shared` and `per_feature`
    sections change only the fields they name (the rest come from `default`)."""

    default: TableSection = TableSection()
    wide: Optional[TableSection] = Field(None, description="first-order (dim 1) tables: changes to `default`")
    shared: dict[str, SharedTable] = Field(default_factory=dict, description="tables used by several features")
    per_feature: dict[str, TableSection] = Field(default_factory=dict, description="settings for one feature's table")


# ------------------------------------------------------------------------------------ training
class DenseOptimizer(_Section):
    name: Literal["adam", "adagrad", "sgd"] = "adam"
    lr: float = Field(0.001, gt=0)
    weight_decay: float = Field(0.0, ge=0)


class TrainConfig(_Section):
    epochs: int = Field(1, ge=1, description="passes over the training rows; unset on a file: up to 100, ended by "
                        "early stopping (docs/own-data.md)")
    max_steps: Optional[int] = Field(None, ge=1)
    early_stopping: Union[bool, Literal["auto"]] = Field(
        "auto", description="end training once the validation AUC has not improved for `patience` evaluations, "
                            "and keep the best step's model; auto: on for a file whose config leaves train.epochs "
                            "unset (hybridrec.train.data_defaults)")
    patience: int = Field(3, ge=1, le=10_000, description="early stopping: evaluations without a better "
                          "validation AUC before training ends")
    dense_optimizer: DenseOptimizer = DenseOptimizer()
    eval_every: int = Field(0, ge=0, description="steps between evaluations; 0 = at the end only")
    log_every: int = Field(50, ge=1)
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints; 0 = only at the end")
    checkpoint_every_s: Optional[float] = Field(None, gt=0, description="seconds between checkpoints (also): a "
                                                "stream's acknowledged position moves with them")
    window: int = Field(100_000, ge=1, description="samples in the windowed progressive AUC and logloss of a "
                                                   "stream (train.window)")
    keep_checkpoints: int = Field(2, ge=1, description="newest checkpoints kept; older ones are deleted")
    output_dir: str = "runs/default"
    threads: Union[int, Literal["auto"]] = Field("auto", description="CPU threads of this process: torch's "
                                                   "intra-op threads, and the embedding pipeline's when it runs; "
                                                   "auto = the CPUs this process may use for a one-process job, "
                                                   "1 per trainer otherwise (see hybridrec/train/threads.py)")
    pipeline: bool = Field(False, description="the pipelined local step (local placement only): the next "
                                              "batch's embedding lookup on its own thread beside the dense step, "
                                              "exact; off by default, since on 2 cores it measured slower than the "
                                              "plain step, whose kernels use every thread (docs/benchmarks.md)")
    publish_dir: Optional[str] = Field(None, description="publish model versions for serving here while training "
                                       "(v-NNNNNNNNN directories: a full version, then deltas; hybridrec serve "
                                       "follows them)")
    publish_every: Union[int, str] = Field(100, description="steps between published versions, or seconds as "
                                           "'<N>s' (e.g. '30s')")
    publish_full_every: int = Field(10, ge=1, description="every k-th published version is a full snapshot; the "
                                    "others are deltas on the version before")
    publish_precision: Literal["fp32", "fp16", "int8"] = Field("fp32", description="the published tables' "
                                                               "weights (hybridrec export --precision)")
    publish_keep_full: int = Field(2, ge=1, description="full snapshots kept in publish_dir with the deltas on "
                                   "them; older versions are deleted")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="the dense part's arithmetic: bf16 = torch "
                                               "autocast (CPU: bfloat16 matmuls), parameters stay fp32")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="dense part's device; auto = cuda when available")
    deterministic: bool = True
    progress: bool = Field(True, description="show progress: a bar on a terminal, a line every progress_every_s "
                           "seconds otherwise (a distributed job's leader's, through its launcher)")
    progress_every_s: float = Field(10.0, gt=0, description="seconds between progress lines when not on a terminal")
    tensorboard: bool = Field(False, description="TensorBoard scalars in <output_dir>/tensorboard; needs "
                              "pip install 'hybridrec[tensorboard]'")

    @field_validator("publish_every")
    @classmethod
    def _publish_every(cls, v):
        if isinstance(v, str):
            text = v.strip()
            try:
                seconds = float(text[:-1]) if text.endswith("s") else None
            except ValueError:
                seconds = None
            if seconds is None or not seconds > 0:
                raise ValueError(f"train.publish_every is {v!r}; allowed: steps (an integer >= 1) or seconds as "
                                 f"'<N>s', e.g. '30s'")
        elif v < 1:
            raise ValueError(f"train.publish_every is {v}; allowed: steps (an integer >= 1) or seconds as '<N>s'")
        return v

    @field_validator("threads")
    @classmethod
    def _threads(cls, v):
        if not isinstance(v, str) and not 1 <= v <= 256:
            raise ValueError(f"train.threads is {v}; allowed: an integer 1..256 or 'auto'")
        return v

    @field_validator("output_dir", "publish_dir")
    @classmethod
    def _a_directory(cls, value):
        """A path that is, or can become, a directory: no existing file on the way to it."""
        if isinstance(value, str):
            path = Path(value)
            for place in (path, *path.parents):
                if place.exists():
                    if not place.is_dir():
                        raise ValueError(f"{value!r}: {str(place)!r} is a file, not a directory; give a directory "
                                         f"(it is made when missing)")
                    break
        return value


_AXES = ("placement", "consistency", "dense", "id_codec", "value_codec")


class RolesSection(_Section):
    """How many processes of each role a distributed job runs when `hybridrec train` (or
    `hybridrec launch` without counts) starts it on this machine."""

    ps_servers: int = Field(2, ge=1, le=256)
    embedding_workers: int = Field(1, ge=0, le=256, description="0: trainers talk to the PS servers directly")
    trainers: int = Field(2, ge=1, le=1024)


class RoleResources(_Section):
    """What one process of a role asks a cluster engine for (`hybridrec launch --ray`: Ray
    reserves it on the node it places the process on). `hybridrec launch` without `--ray`
    reserves nothing."""

    cpus: float = Field(1.0, ge=0, le=1024, description="logical CPUs (fractions allowed)")
    gpus: float = Field(0.0, ge=0, le=64, description="GPUs (trainers only: the dense part runs on them)")
    memory_gb: float = Field(0.0, ge=0, description="memory in GiB Ray reserves; 0: none")


class ResourcesSection(_Section):
    """Resources per process of each role, keyed as `roles` is: `ps_servers`,
    `embedding_workers`, `trainers`, and `group_ps` (Hierarchical Training's group PSs, each
    `cpus`, `gpus`, `memory_gb`). The server roles run on CPUs only, so they may not ask for
    GPUs."""

    ps_servers: RoleResources = RoleResources()
    embedding_workers: RoleResources = RoleResources()
    trainers: RoleResources = RoleResources()
    group_ps: RoleResources = RoleResources()

    @model_validator(mode="after")
    def _gpus_for_trainers_only(self):
        for role in ("ps_servers", "embedding_workers", "group_ps"):
            gpus = getattr(self, role).gpus
            if gpus:
                raise ValueError(f"{role}.gpus is {gpus:g}, but {role} run on CPUs only: allowed is 0 "
                                 f"(give GPUs to trainers.gpus)")
        return self


class PlanSection(_Section):
    """The cost model `hybridrec plan` places the dense model's operators with (HT §3.2.1): each
    trainer's and group PS's CPU, network and memory, and how long greedy refinement may run."""

    trainer_gflops: float = Field(50.0, gt=0, description="a trainer's dense compute, GFLOP/s")
    group_ps_gflops: float = Field(50.0, gt=0, description="a group PS's dense compute, GFLOP/s")
    network_gbit: float = Field(10.0, gt=0, description="each device's network bandwidth each way, Gbit/s")
    trainer_memory_gb: float = Field(16.0, gt=0, description="memory a trainer gives the dense part, GiB")
    group_ps_memory_gb: float = Field(16.0, gt=0, description="memory of a group PS, GiB")
    refine_seconds: float = Field(5.0, ge=0, le=3600, description="time limit of the greedy refinement")


class HierarchicalSection(_Section):
    """Hierarchical Training (dense `groups`, preset `ht`) and its baseline (dense `easgd`): the
    trainers form `groups` groups of equal size, each training ONE dense copy without locks
    (Hogwild), and every group's copy is pulled toward a centre copy on the PS servers by elastic
    averaging in a background thread. `easgd` is one group per trainer."""

    groups: int = Field(1, ge=1, le=1024, description="groups: dense copies (the trainers divide evenly among them)")
    group_ps: int = Field(0, ge=0, le=64, description="group PS processes per group, running the layers the "
                                                     "operator placement puts on them; 0: the group's dense copy "
                                                     "lives in shared memory on its trainers' host")
    wire_codec: Literal["none", "bf16", "int8", "topk"] = Field(
        "none", description="activations and gradients between trainers and group PSs: none | bf16 | int8 (int8 "
                            "activations, bf16 gradients) | topk (float32 activations, top-k gradients with error "
                            "feedback, strategy.topk_ratio)")
    alpha: float = Field(0.1, gt=0, le=1, description="elastic averaging rate: each sync moves the copy and the "
                                                     "centre alpha of the way toward each other")
    period: int = Field(4, ge=1, le=1_000_000, description="steps of a copy between two elastic syncs")
    plan: PlanSection = PlanSection()


class PicassoSection(_Section):
    """PICASSO's switches for the sharded placement (preset `picasso`): packing, interleaving and
    the HybridHash hot/cold cache (consistency `hot_cold`). With every switch off the sharded
    placement is the plain model-parallel lookup: one AllToAll round per table."""

    packing: bool = Field(True, description="D-packing (one lookup per dim) with the fused Unique&Partition "
                                            "and Shuffle&Stitch kernels; off: every table looked up on its own")
    split_packs: bool = Field(False, description="split a pack whose parameter volume (PICASSO Eq. 1) is above "
                                                 "the average into shards of about the smallest pack's volume")
    interleaving: Union[bool, Literal["auto"]] = Field(
        "auto", description="D-interleaving: each batch in micro_batches parts whose AllToAll overlaps the dense "
                            "compute of the part before; auto: on where a trainer has 2 cores of its own "
                            "(hybridrec.picasso.switches says why not in final_metrics.json)")
    micro_batches: int = Field(2, ge=1, le=64, description="D-interleaving: parts per batch (gradients "
                                                          "accumulated, one update per batch)")
    k_groups: int = Field(1, ge=1, le=64, description="K-interleaving: groups of packed operations (Eq. 3: "
                                                     "capacity = parameter volume / k_groups) pipelined so "
                                                     "that one group's AllToAll overlaps another's lookup")
    hot_rows: int = Field(4096, ge=0, description="hot_cold: rows (all tables together) copied to every trainer")
    warmup_iters: int = Field(100, ge=0, description="hot_cold: steps that only count key frequencies")
    flush_iters: int = Field(100, ge=1, description="hot_cold: steps between two choices of the hot rows")


class HetSection(_Section):
    """HET (consistency `het`, preset `het`): each trainer keeps a cache of embedding rows and
    reads a cached row while its clocks stay within `staleness` of the servers' (HET §3), writing
    its updates back only when the entry is evicted or falls out of that bound. The cache of a
    table holds `cache_rows` rows (one number for every table, or per table name) or, unset,
    `cache_fraction` of the table's capacity."""

    staleness: Union[int, Literal["inf"]] = Field(100, description="s, the per-embedding clock bound: 0 is BSP; "
                                                  "inf never checks (entries synchronise only when evicted)")
    cache_rows: Optional[Union[int, dict[str, int]]] = Field(None, description="rows of each table's cache, or "
                                                             "{table: rows}; unset: cache_fraction")
    cache_fraction: float = Field(0.1, gt=0, le=1, description="a table's cache as a fraction of its capacity")
    policy: Literal["lru", "lfu", "light_lfu"] = Field("lfu", description="which entry a full cache evicts")
    light_lfu_threshold: int = Field(10, ge=1, le=1000, description="light_lfu: uses after which an entry is "
                                     "pinned and no longer counted")

    @field_validator("staleness", mode="before")
    @classmethod
    def _infinite(cls, value):
        if isinstance(value, float) and value == float("inf"):
            return "inf"
        if isinstance(value, str) and value.strip().lower() in ("inf", "infinity", ".inf"):
            return "inf"
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"staleness must be an int >= 0 or inf, got {value}")
        return value

    @field_validator("cache_rows")
    @classmethod
    def _rows(cls, value):
        counts = value.values() if isinstance(value, dict) else [] if value is None else [value]
        if any(not 1 <= n < 2**30 for n in counts):
            raise ValueError(f"cache_rows must be in [1, 2**30), got {value!r}")
        return value

    @property
    def s(self) -> int | None:
        """The staleness bound, None for infinity."""
        return None if self.staleness == "inf" else int(self.staleness)


class SspSection(_Section):
    """Stale synchronous parallel (consistency `ssp`): a trainer looks up the rows of its
    iteration c only when every trainer has finished (its updates acknowledged) iteration
    c - staleness; so no trainer runs more than `staleness` iterations ahead of the slowest."""

    staleness: int = Field(3, ge=0, le=1_000_000, description="iterations a trainer may run ahead of the slowest")


class AspSection(_Section):
    """Asynchronous parallel (consistency `asp`): lookups never wait for any update, this
    trainer's or another's; `read_ahead` batches are looked up ahead of the training step."""

    read_ahead: int = Field(4, ge=1, le=1024, description="batches looked up ahead of the step")


class StrategyConfig(_Section):
    """How a job trains: a preset named after a paper (`local`, `persia`) expanded to the four
    axes of hybridrec.axes, each of which may be set here to override the preset:
    `placement` (where embeddings live), `consistency` (how stale a lookup may be), `dense` (how
    the dense parameters are synchronised) and the wire codecs `id_codec` and `value_codec`.
    `resolved` holds the outcome; impossible combinations are refused at load time."""

    preset: Optional[str] = Field(None, description="local (default) or persia; sets every axis")
    placement: Optional[str] = Field(None, description="local | ps")
    consistency: Optional[str] = Field(None, description="sync | bounded")
    dense: Optional[str] = Field(None, description="allreduce | ps_async")
    id_codec: Optional[str] = Field(None, description="ID features from trainer to embedding worker: none | unique")
    value_codec: Optional[str] = Field(None, description="rows and gradients on the wire: none | fp16 | bf16")
    dense_codec: Literal["none", "bf16", "topk"] = Field("none", description="dense gradients of the allreduce "
                                                          "sync: none | bf16 | topk (error feedback)")
    topk_ratio: float = Field(0.01, gt=0, le=1, description="dense_codec topk: share of entries sent per step")
    tau: int = Field(4, ge=0, le=1024, description="bounded: batches in flight between lookup and update")
    request_timeout: float = Field(30.0, gt=0, description="seconds per request attempt")
    retries: int = Field(3, ge=0, le=100, description="retries of idempotent requests after a timeout")
    max_buffered_batches: int = Field(256, ge=1, description="batches an embedding worker buffers; older ones are dropped and counted")
    ps_replicas: int = Field(1, ge=1, le=2, description="copies of every embedding bucket on the PS servers: 1, or 2 "
                             "(a primary and a backup with synchronous forwarding; a lost server fails over)")
    roles: RolesSection = RolesSection()
    resources: ResourcesSection = ResourcesSection()
    ht: HierarchicalSection = HierarchicalSection()
    picasso: PicassoSection = PicassoSection()
    het: HetSection = HetSection()
    ssp: SspSection = SspSection()
    asp: AspSection = AspSection()

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data):
        if isinstance(data, dict):
            if "name" in data:
                raise ValueError(f"strategy.name ({data['name']!r}) is now strategy.preset")
            if "discipline" in data:
                raise ValueError(f"strategy.discipline ({data['discipline']!r}) is now two axes: sync = "
                                 "consistency sync; hybrid = consistency bounded; async = consistency bounded "
                                 "+ dense ps_async")
        return data

    @model_validator(mode="after")
    def _axes(self):
        """Every axis field holds its resolved value from here on (the preset's unless set)."""
        from hybridrec.axes import resolve

        for axis, value in resolve(self.preset, {axis: getattr(self, axis) for axis in _AXES}).items():
            object.__setattr__(self, str(axis), value)  # the axis's enum member (a str)
        return self

    @model_validator(mode="after")
    def _groups_fit(self):
        """Hierarchical Training's groups divide the trainers evenly; a wire codec needs group PSs."""
        if self.dense == "groups":
            if self.roles.trainers % self.ht.groups:
                raise ValueError(f"strategy.ht.groups {self.ht.groups}: {self.roles.trainers} trainers "
                                 f"(strategy.roles.trainers) do not divide into {self.ht.groups} groups of equal "
                                 "size; allowed: a divisor of the trainer count")
        if self.ht.wire_codec != "none" and not self.ht.group_ps:
            raise ValueError(f"strategy.ht.wire_codec {self.ht.wire_codec}: it compresses what travels between "
                             "trainers and group PSs, and strategy.ht.group_ps is 0; set group_ps >= 1 or leave "
                             "the codec at none")
        return self

    @model_validator(mode="after")
    def _het_route(self):
        """HET's trainers talk to the PS servers directly: no embedding workers unless asked for,
        and asking for them is refused."""
        if self.consistency == "het":
            if "embedding_workers" not in self.roles.model_fields_set:
                object.__setattr__(self, "roles", self.roles.model_copy(update={"embedding_workers": 0}))
            elif self.roles.embedding_workers:
                raise ValueError(f"strategy.roles.embedding_workers {self.roles.embedding_workers}: HET's trainers "
                                 "talk to the PS servers directly; allowed: 0")
        return self

    @property
    def resolved(self) -> dict[str, str]:
        """The axis values this job runs with (the preset's, overridden by the axes set)."""
        return {axis: getattr(self, axis) for axis in _AXES}

    @property
    def distributed(self) -> bool:
        return self.resolved["placement"] != "local"

    @property
    def effective_tau(self) -> int:
        """Batches allowed between a lookup and its update: 0 unless consistency is bounded (tau),
        ssp (its staleness) or asp (its read-ahead)."""
        return {"bounded": self.tau, "ssp": self.ssp.staleness, "asp": self.asp.read_ahead}.get(
            self.resolved["consistency"], 0)

    def record(self) -> dict:
        """What a result file says about the strategy that produced it."""
        record = {"preset": self.preset or "local", **self.resolved, "tau": self.effective_tau}
        consistency = self.resolved["consistency"]
        if consistency in ("het", "ssp", "asp"):
            record[consistency] = getattr(self, consistency).model_dump()
        return record


class JobConfig(_Section):
    seed: int = Field(0, ge=0)
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    embedding: EmbeddingSection = EmbeddingSection()
    train: TrainConfig = TrainConfig()
    strategy: StrategyConfig = StrategyConfig()

    @model_validator(mode="after")
    def _substitutable(self):
        """The des dense sync substitutes the first layers of a few models exactly; others are refused."""
        if self.strategy.dense == "des":
            from hybridrec.des.substitution import des_refusal

            reason = des_refusal(self.model.name, self.model.hparams)
            if reason:
                raise ValueError(f"strategy.dense: des (distributed equivalent substitution): {reason}")
        return self


# ------------------------------------------------------------------------------------ loading
def _hint(name, choices) -> str:
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _section_type(annotation):
    """The _Section class inside an annotation like Optional[X] or dict[str, X], and the kind."""
    origin = typing.get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, "model"
    if origin in (dict,):
        args = typing.get_args(annotation)
        inner, kind = _section_type(args[1]) if len(args) == 2 else (None, None)
        return (inner, "dict") if kind == "model" else (None, None)
    if origin in (Union, getattr(__import__("types"), "UnionType", Union)):
        for arg in typing.get_args(annotation):
            inner, kind = _section_type(arg)
            if inner is not None:
                return inner, kind
    return None, None


def _unknown_keys(data, model: type[BaseModel], path: str, problems: list):
    """Report keys the schema does not know, with the closest valid one."""
    if not isinstance(data, dict):
        return
    if model.model_config.get("extra") == "allow":
        return
    fields = {}
    for name, field in model.model_fields.items():
        fields[field.alias or name] = field
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields:
            problems.append((where, f"unknown key {key!r}{_hint(key, fields)}; allowed: {sorted(fields)}"))
            continue
        inner, kind = _section_type(fields[key].annotation)
        if inner is None:
            continue
        if kind == "model":
            _unknown_keys(value, inner, where, problems)
        elif isinstance(value, dict):
            for k, v in value.items():
                _unknown_keys(v, inner, f"{where}.{k}", problems)


def _line_map(text: str) -> dict[str, int]:
    """Dotted key path -> 1-based line in the YAML text."""
    lines: dict[str, int] = {}

    def walk(node, path):
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                where = f"{path}.{key_node.value}" if path else str(key_node.value)
                lines[where] = key_node.start_mark.line + 1
                walk(value_node, where)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, f"{path}.{i}")

    try:
        walk(yaml.compose(text), "")
    except yaml.YAMLError:
        pass
    return lines


def _located(source: str, lines: dict[str, int], where: str) -> str:
    probe = where
    while probe and probe not in lines:
        probe = probe.rpartition(".")[0]
    return f"{source}:{lines[probe]}" if probe in lines else source


def parse_config(data: dict, source: str = "<config>", text: str | None = None,
                 overrides: dict[str, str] | None = None) -> JobConfig:
    """Validate plain data into a JobConfig; ConfigError lists every problem with its place.

    `overrides` maps dotted keys set on the command line to their `--set` text, so problems
    there are reported as coming from `--set`, not from the file."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(data).__name__}")
    lines = _line_map(text) if text else {}
    overrides = overrides or {}
    problems: list = []
    _unknown_keys(data, JobConfig, "", problems)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "literal[")))
            where = where.replace("schema_", "schema")
            if err["type"] == "extra_forbidden" and any(w == where for w, _ in problems):
                continue  # already reported with the closest valid name
            msg = err["msg"].removeprefix("Value error, ")
            named = re.match(r"((?:strategy|data\.schema|data\.stream|model)\.\w+):? (.*)", msg, re.S)  # errors naming their own key
            if named:
                where, msg = named.groups()
            if err["type"] not in ("value_error", "assertion_error") and "input" in err:
                msg = f"{msg} (got {err['input']!r})"
            if err["type"] == "literal_error":
                allowed = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
                msg += _hint(err.get("input"), allowed)
            problems.append((where, msg))
    raise ConfigError("\n".join(f"{_place(source, lines, overrides, w)}: {w or '(top level)'}: {m}"
                                 for w, m in problems))


def _place(source: str, lines: dict[str, int], overrides: dict[str, str], where: str) -> str:
    """'--set KEY=VALUE' when `where` (or a section above it) was set on the command line,
    else 'file:line' of the closest enclosing key in the YAML."""
    probe = where
    while probe:
        if probe in overrides:
            return f"--set {overrides[probe]}"
        probe = probe.rpartition(".")[0]
    for key, item in overrides.items():
        if key.startswith(where + ".") and where:
            return f"--set {item}"
    return _located(source, lines, where)


def apply_overrides(data, overrides: list[str]) -> tuple[dict, dict[str, str]]:
    """Apply 'a.b.c=value' strings (values parsed as YAML) to config data; returns the new data
    and {dotted key: the override text} for error messages."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"--set: the config's top level must be a mapping, got {type(data).__name__}")
    applied: dict[str, str] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set: expected KEY.PATH=VALUE (e.g. train.epochs=2), got {item!r}")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {item}: the value is not valid YAML: {exc}") from None
        node = data
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item}: {'.'.join(parts[:depth + 1])} is a value, not a section")
        node[parts[-1]] = parsed
        applied[key] = item
    return data, applied


def load_config(path, overrides: list[str] | None = None) -> JobConfig:
    """Read and validate a YAML job file; `overrides` are 'a.b.c=value' strings (YAML values)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config: file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None and not overrides:  # empty, or comments only: a default job nobody asked for
        raise ConfigError(f"{path}: the config is empty; give its sections (data, model, train, ...; see configs/ "
                          f"for examples), or --set KEY=VALUE for each setting to change from the defaults")
    if overrides:
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
        data, applied = apply_overrides(data, overrides)
        for note in switch_model_hparams(data, applied):
            print(f"config: {note}", file=sys.stderr, flush=True)
    else:
        applied = {}
    return parse_config(data, str(path), text, applied)


def switch_model_hparams(data: dict, applied: dict[str, str]) -> list[str]:
    """When `--set model.name=X` switches the model and no --set names a hyper-parameter, drop the
    file's model.hparams that X does not take (they belong to the model the file names); the
    notes saying what was dropped. Hyper-parameters given with --set are checked as ever."""
    model = data.get("model")
    if "model.name" not in applied or any(key.startswith("model.hparams") for key in applied) \
            or not isinstance(model, dict) or not isinstance(model.get("hparams"), dict):
        return []
    from hybridrec.models import MODELS, model_hparams

    name = model.get("name")
    try:
        allowed = model_hparams(name) if isinstance(name, str) and (name in MODELS or ":" in name) else None
    except Exception:  # a name that does not resolve: its own error is reported by validation
        allowed = None
    if allowed is None:
        return []
    dropped = [key for key in model["hparams"] if key not in allowed]
    for key in dropped:
        del model["hparams"][key]
    if not dropped:
        return []
    return [f"--set {applied['model.name']}: dropped model.hparams {', '.join(dropped)} (the config's, which {name} does "
            f"not take; {name} takes {', '.join(sorted(allowed)) or 'none'}: --set model.hparams.KEY=VALUE)"]
