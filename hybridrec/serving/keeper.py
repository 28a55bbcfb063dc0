"""The version a prediction server answers from, and how it moves.

`VersionKeeper` holds the current `Predictor`. Following a directory of versions, a background
thread looks at it every `poll_seconds`; a newer complete version is read beside the one being
served (the deltas between them applied to a copy, or its full version read) and only then
swapped in by one reference assignment, so a request never sees a half-applied version and none
fails during the swap. `pin(V)` (`--version V`, `POST /rollback`) serves version V and stops
following; `follow()` follows the newest again. A version that cannot be read is reported once
and skipped; the server keeps the one it has.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from hybridrec.bundle import chain
from hybridrec.bundle.format import VERSION_NAME, BundleError, complete_versions, is_version
from hybridrec.serving.predictor import Predictor

log = logging.getLogger(__name__)


class VersionKeeper:
    def __init__(self, source, version: int | None = None, poll_seconds: float = 0.2, predictor=Predictor):
        """`predictor(version)` makes what scores a loaded version (`Predictor`; a benchmark's peer
        gives its own)."""
        source = Path(source)
        self.predictor = predictor
        self.root = source.parent if is_version(source) and VERSION_NAME.fullmatch(source.name) else source
        self.follows_directory = not is_version(source) or VERSION_NAME.fullmatch(source.name) is not None
        self.poll_seconds = poll_seconds
        self.current = predictor(chain.load(chain.resolve(source, version)))
        self.pinned = version is not None or not self.follows_directory
        self.swaps = 0
        self._load_lock = threading.Lock()
        self._failed: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def version(self) -> int:
        return self.current.number

    def available(self) -> list[int]:
        return sorted(complete_versions(self.root)) if self.follows_directory else [self.version]

    def _swap(self, predictor: Predictor) -> None:
        self.current = predictor  # one assignment: a request holds the old one or the new one
        self.swaps += 1

    def _load(self, number: int) -> Predictor:
        path = chain.resolve(self.root, number) if self.follows_directory else chain.resolve(self.root)
        return self.predictor(chain.advance(self.current.version, path))

    def pin(self, number: int | None = None) -> int:
        """Serve version `number` (default: the newest one older than the one served) and stay on
        it; returns it. BundleError when there is no such version."""
        with self._load_lock:
            if number is None:
                older = [n for n in self.available() if n < self.version]
                if not older:
                    raise BundleError(f"rollback: no version older than {self.version} in {self.root}")
                number = older[-1]
            if number != self.version:
                self._swap(self._load(number))
            self.pinned = True
            return number

    def follow(self) -> int:
        """Follow the newest version again; returns the version served."""
        if not self.follows_directory:
            raise BundleError(f"follow: {self.root} is one bundle, not a directory of versions")
        self.pinned = False
        self.poll_once()
        return self.version

    def poll_once(self) -> bool:
        """Move to the newest complete version if it is newer; whether the served one changed."""
        if self.pinned:
            return False
        with self._load_lock:
            if self.pinned:
                return False
            versions = [n for n in self.available() if n not in self._failed]
            if not versions or versions[-1] <= self.version:
                return False
            newest = versions[-1]
            try:
                predictor = self._load(newest)
            except (BundleError, OSError, ValueError, KeyError) as exc:
                self._failed.add(newest)
                log.warning("hybridrec serve: version %s cannot be read, keeping version %s: %s", newest,
                            self.version, exc)
                return False
            self._swap(predictor)
            return True

    def start(self) -> None:
        if self.follows_directory and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="hybridrec-version-watch", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - the watcher must outlive any one bad version
                log.exception("hybridrec serve: looking for new versions failed")
                time.sleep(self.poll_seconds)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
