"""What a job's config decides in every version of its model: the architecture, the feature
pipeline, the strategy it was trained with. `hybridrec export` and the training publisher start
their manifests from `job_fields`."""
from __future__ import annotations

import datetime

from hybridrec.bundle.features import FeatureSpec
from hybridrec.bundle.model import model_spec


def job_fields(cfg, tables, precision: str, source: str) -> dict:
    """The manifest fields of a version of a job's model (the format adds tables and files)."""
    return {"precision": precision, "source": source, "strategy": cfg.strategy.record(),
            "model": model_spec(cfg, tables), "features": FeatureSpec.of_job(cfg).to_dict(), "missing_ids": "zeros"}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
