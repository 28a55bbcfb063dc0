"""Streams as training data: a source that yields batches without end and carries a position
that checkpoints record (see source.py for the contract). Backends live in `backends/`, one module
each, found by name: `files` (a directory into which complete files keep arriving) and `redis`
(Redis Streams through a consumer group). A new backend (Kafka, say) is one new module there."""
from __future__ import annotations

import importlib
import pkgutil

from pydantic import ValidationError

from hybridrec.data.stream.source import (BadRecord, CommonOptions, StreamContext, StreamSource, empty_batch)
from hybridrec.errors import UserError

__all__ = ["BadRecord", "CommonOptions", "StreamContext", "StreamSource", "empty_batch", "backend_names",
           "backend_class", "parse_stream_options", "open_source"]


def backend_names() -> list[str]:
    """The names of the backends this installation has (the modules of backends/)."""
    from hybridrec.data.stream import backends as package

    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))


def backend_class(name: str) -> type[StreamSource]:
    """The StreamSource subclass of backend `name`; UserError naming the backends there are."""
    if not isinstance(name, str) or name not in backend_names():
        raise UserError(f"data.stream.backend: {name!r} is not a stream backend; allowed: {backend_names()}")
    module = importlib.import_module(f"hybridrec.data.stream.backends.{name}")
    found = [v for v in vars(module).values()
             if isinstance(v, type) and issubclass(v, StreamSource) and v is not StreamSource and v.name == name]
    if len(found) != 1:
        raise TypeError(f"backends/{name}.py must define one StreamSource subclass with name {name!r} "
                        f"(a bug in hybridrec)")
    return found[0]


def parse_stream_options(spec: dict) -> tuple[type[StreamSource], object, CommonOptions]:
    """(backend class, its options, the common options) of a `data.stream` mapping; ValueError
    naming `data.stream.<key>`, the value and what is allowed."""
    if not isinstance(spec, dict):
        raise ValueError(f"data.stream must be a mapping with a `backend` key, got {spec!r}")
    if "backend" not in spec:
        raise ValueError(f"data.stream.backend is required; allowed: {backend_names()}")
    cls = backend_class(spec["backend"])
    rest = {k: v for k, v in spec.items() if k != "backend"}
    common_keys = set(CommonOptions.model_fields)
    mine = set(cls.Options.model_fields)
    unknown = sorted(set(rest) - common_keys - mine)
    if unknown:
        raise ValueError(f"data.stream.{unknown[0]}: not a key of backend {cls.name!r}; allowed: "
                         f"{sorted(common_keys | mine | {'backend'})}")
    try:
        common = CommonOptions(**{k: v for k, v in rest.items() if k in common_keys})
        options = cls.Options(**{k: v for k, v in rest.items() if k in mine})
    except ValidationError as exc:
        problems = [f"data.stream.{'.'.join(str(p) for p in e['loc'])}: {e['msg'].removeprefix('Value error, ')} "
                    f"(got {e.get('input')!r})" for e in exc.errors()]
        raise ValueError("; ".join(problems)) from None
    return cls, options, common


def open_source(spec: dict, context: StreamContext) -> StreamSource:
    """The source of a `data.stream` mapping for one trainer (`context`)."""
    cls, options, common = parse_stream_options(spec)
    return cls(options, common, context)
