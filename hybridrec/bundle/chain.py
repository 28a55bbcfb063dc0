"""Resolving a version: a full version is read as it is; a delta is applied to the version it is
based on, back to the nearest full one (`v-N` directories of one directory of versions).

`load` returns a `Version`: the tables ready to serve, the dense state, the feature pipeline and
the manifest. `advance` moves a loaded version forward to a newer one, applying only the deltas in
between when they chain onto it, so a server follows a training job without re-reading the full
snapshot each time.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from hybridrec.bundle.features import FeatureSpec
from hybridrec.bundle.format import (BundleError, complete_versions, is_version, read_dense, read_manifest,
                                     read_table, VERSION_NAME)
from hybridrec.bundle.tables import ServingTable


@dataclasses.dataclass
class Version:
    number: int
    path: Path
    manifest: dict
    dense_state: dict
    tables: dict[str, ServingTable]
    features: FeatureSpec

    @property
    def step(self) -> int:
        return int(self.manifest.get("step", 0))

    def describe(self) -> dict:
        m = self.manifest
        return {"version": self.number, "kind": m.get("kind"), "step": self.step, "precision": m.get("precision"),
                "stream_position": m.get("stream_position"), "created": m.get("created"), "path": str(self.path),
                "source": m.get("source"), "rows": {name: len(t) for name, t in self.tables.items()}}


def _number(path: Path, manifest: dict) -> int:
    return int(manifest.get("version", 0))


def _full(path: Path, manifest: dict) -> Version:
    tables = {name: ServingTable(read_table(path, manifest, name)) for name in manifest["tables"]}
    return Version(_number(path, manifest), path, manifest, read_dense(path, manifest), tables,
                   FeatureSpec.from_dict(manifest["features"]))


def _applied(previous: Version, path: Path, manifest: dict) -> Version:
    if manifest.get("base") != previous.number:
        raise BundleError(f"bundle: {path} is a delta on version {manifest.get('base')}, not on {previous.number}")
    if set(manifest["tables"]) != set(previous.tables):
        raise BundleError(f"bundle: {path} has tables {sorted(manifest['tables'])}; version {previous.number} has "
                          f"{sorted(previous.tables)}")
    tables = {name: previous.tables[name].apply(read_table(path, manifest, name)) for name in manifest["tables"]}
    return Version(_number(path, manifest), path, manifest, read_dense(path, manifest), tables,
                   FeatureSpec.from_dict(manifest["features"]))


def _chain(path: Path, manifest: dict) -> list[tuple[Path, dict]]:
    """The versions to read for `path`, the full one first."""
    chain = [(path, manifest)]
    versions = complete_versions(path.parent)
    while manifest.get("kind") == "delta":
        base = manifest.get("base")
        if base not in versions:
            raise BundleError(f"bundle: {chain[-1][0]} is a delta on version {base}, which is not in {path.parent} "
                              f"(deleted, or never complete)")
        path = versions[base]
        manifest = read_manifest(path)
        chain.append((path, manifest))
    return chain[::-1]


def load(path) -> Version:
    """The version in directory `path` (deltas resolved against their directory)."""
    path = Path(path)
    chain = _chain(path, read_manifest(path))
    version = _full(*chain[0])
    for step_path, manifest in chain[1:]:
        version = _applied(version, step_path, manifest)
    return version


def advance(current: Version | None, path) -> Version:
    """The version in `path`, from `current` when the versions between them are deltas that chain
    onto it (fewer bytes read), else from its full version."""
    path = Path(path)
    if current is not None and current.path.parent == path.parent:
        chain = _chain(path, read_manifest(path))
        numbers = [_number(p, m) for p, m in chain]
        if current.number in numbers:
            version = current
            for step_path, manifest in chain[numbers.index(current.number) + 1:]:
                version = _applied(version, step_path, manifest)
            return version
    return load(path)


def resolve(source, version: int | None = None) -> Path:
    """The version directory `source` names: a version directory itself, or in a directory of
    versions the newest complete one (or version `version`)."""
    source = Path(source)
    if not source.exists():
        raise BundleError(f"bundle: {source} does not exist")
    if is_version(source):
        if version is None or int(read_manifest(source).get("version", 0)) == version:
            return source
        if not VERSION_NAME.fullmatch(source.name):
            raise BundleError(f"bundle: {source} holds version {read_manifest(source).get('version')}, not {version}")
        source = source.parent
    versions = complete_versions(source)
    if not versions:
        raise BundleError(f"bundle: {source} holds no complete version (no manifest.json, no v-NNNNNNNNN "
                          f"directory); write one with `hybridrec export` or train.publish_dir")
    if version is None:
        return versions[max(versions)]
    if version not in versions:
        raise BundleError(f"bundle: {source} holds no version {version}; it holds {sorted(versions)}")
    return versions[version]
