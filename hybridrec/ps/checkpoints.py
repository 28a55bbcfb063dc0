"""A PS server's checkpoint and load requests: where they may go, how a retry finds its own
work, and how a long one runs without holding a request thread.

* Where. Every directory lies inside the server's checkpoint root, opened once when the server
  starts (`CheckpointRoot`). A request's path is taken apart lexically (a relative path starts
  at the root; an absolute one must start with the root's path; no '..') and opened one
  component at a time from the root's handle, never following a symlink
  (`hybridrec.embedding.dir_handle`). Every file is then written, renamed, removed and read
  through those handles, so a symlink swapped in, or a directory renamed, during the work
  cannot redirect it outside the root.
* Idempotent. A checkpoint first writes a marker file (`MARKER`: the request's token and
  "writing"), then the tables and dense params, then marks itself "complete". The same request
  again (same directory, same token: a retry after a timeout, or after this server was
  restarted mid-checkpoint) finds its marker: complete, it is answered done; still writing, the
  entries it writes are removed and written again. A directory holding anything else (no
  marker, or another token's) is refused, so a checkpoint never replaces files it did not write.
* Asynchronous. The work runs in a background thread (one checkpoint or load at a time per
  server); a request waits up to `wait` seconds for it and otherwise answers
  {"state": "running"}. Sending the same request again polls it: "running", "done" (with the
  directory and tables), or the error that ended it (after which the next identical request
  starts it again). A load with the same token as a finished one is answered done without
  reading the files again.
"""
from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hybridrec.embedding.dir_handle import DirHandle

MARKER = ".hybridrec-checkpoint.json"
WAIT_SECONDS = 2.0  # how long a request waits for its job before it answers "running"
MAX_WAIT_SECONDS = 10.0  # a request's meta 'wait' is capped here: no request thread is held longer
KEPT_JOBS = 16  # finished jobs remembered for retries of their requests
_TOKEN = re.compile(r"[A-Za-z0-9._-]{1,128}")


class CheckpointRoot:
    """The directory inside which a server writes and loads checkpoints, opened once."""

    def __init__(self, root: str | Path):
        self.given = os.path.abspath(os.fspath(root))
        self.path = str(Path(root).resolve())
        self.handle = DirHandle.open(self.path, create=True)

    def close(self) -> None:
        self.handle.close()

    def parts(self, directory: Any) -> list[str]:
        """The components of meta 'directory' below the root (ValueError when it leaves it)."""
        if not isinstance(directory, str) or not directory or "\0" in directory or len(directory) > 4096:
            raise ValueError(f"meta 'directory' must be a non-empty path string (at most 4096 characters), "
                             f"got {directory!r:.100}")
        relative = directory
        if os.path.isabs(directory):
            for root in (self.path, self.given):
                if directory == root or directory.startswith(root.rstrip("/") + "/"):
                    relative = directory[len(root):]
                    break
            else:
                raise ValueError(f"meta 'directory' {directory!r:.300} lies outside this server's checkpoint root "
                                 f"{self.path!r}; give a path inside it")
        parts = [part for part in relative.split("/") if part not in ("", ".")]
        if ".." in parts:
            raise ValueError(f"meta 'directory' {directory!r:.300} climbs with '..', outside this server's checkpoint "
                             f"root {self.path!r}; give a path inside it")
        return parts

    def open(self, parts: list[str], *, create: bool) -> DirHandle:
        """The directory `parts` below the root, through handles (a symlink in it is refused)."""
        shown = os.path.join(self.path, *parts)
        try:
            return self.handle.walk(parts, create=create)
        except NotADirectoryError as error:
            raise ValueError(f"meta 'directory' {shown!r:.300} passes through {error}; this server follows no "
                             f"symlink inside its checkpoint root {self.path!r}") from None
        except FileNotFoundError:
            raise ValueError(f"meta 'directory' {shown!r:.300} does not exist") from None


@dataclass
class _Job:
    kind: str
    shown: str
    token: str | None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    reported: bool = False  # its error reached a request (the next identical one starts afresh)
    result: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)  # the request's meta, which a load reads

    def reply(self) -> dict:
        if not self.done.is_set():
            return {"state": "running", "directory": self.shown}
        if self.error is not None:
            self.reported = True
            raise self.error
        return {"state": "done", "directory": self.shown, **self.result}


class CheckpointJobs:
    """The checkpoint and load requests of one server (see the module docstring).

    `entries()` names what a checkpoint writes into its directory; `write(handle)` saves every
    table and the dense params into the open checkpoint directory and returns the tables' names;
    `read(handle, meta)` replaces them from one (as the request's meta says) and returns the tables' names."""

    def __init__(self, root: CheckpointRoot | None, entries: Callable[[], list[str]],
                 write: Callable[[DirHandle], list[str]], read: Callable[[DirHandle, dict], list[str]]):
        self.root = root
        self._entries, self._write, self._read = entries, write, read
        self._lock = threading.Lock()
        self._jobs: dict[tuple[str, str], _Job] = {}  # (kind, directory) -> the latest job there
        self._running: _Job | None = None

    def request(self, kind: str, meta: dict) -> dict:
        """The reply meta of a `checkpoint` or `load` request: start its job, or poll it."""
        if self.root is None:
            raise ValueError("this server has no checkpoint root, so it refuses checkpoint and load requests; "
                             "start it with --checkpoint-root DIR (hybridrec launch gives train.output_dir)")
        parts = self.root.parts(meta.get("directory"))
        token = meta.get("token")
        if token is not None and (not isinstance(token, str) or not _TOKEN.fullmatch(token)):
            raise ValueError(f"meta 'token' must be 1-128 letters, digits, '.', '_' or '-', got {token!r:.140}")
        wait = meta.get("wait", WAIT_SECONDS)
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= MAX_WAIT_SECONDS:
            raise ValueError(f"meta 'wait' must be a number of seconds in [0, {MAX_WAIT_SECONDS}], got {wait!r:.40}")
        key = (kind, "/".join(parts))
        with self._lock:
            job = self._jobs.get(key)
            if job is not None and job.token == token and not (job.error is not None and job.reported):
                pass  # this request's job: running, done (a retry of its reply) or failed (not yet told)
            elif self._running is not None and not self._running.done.is_set():
                raise ValueError(f"a {self._running.kind} of {self._running.shown!r} is running on this server; "
                                 f"send this request again once it has finished")
            else:
                job = self._start(kind, parts, token, key, meta)
        job.done.wait(wait)
        return job.reply()

    def _start(self, kind: str, parts: list[str], token: str | None, key: tuple[str, str], meta: dict) -> _Job:
        """A new job (the lock is held). The directory is opened, and a checkpoint's checked
        and prepared, before this returns, so a bad request fails at once."""
        handle = self.root.open(parts, create=kind == "checkpoint")
        job = _Job(kind, handle.path, token, options=dict(meta))
        try:
            if kind == "checkpoint" and self._prepare(handle, token, self._entries()):
                job.result = {"tables": (_read_marker(handle) or {}).get("tables", [])}
                job.done.set()
                handle.close()
                return self._remember(key, job)
        except BaseException:
            handle.close()
            raise
        self._running = job
        threading.Thread(target=self._run, args=(job, handle), name=f"ps-{kind}", daemon=True).start()
        return self._remember(key, job)

    def _remember(self, key: tuple[str, str], job: _Job) -> _Job:
        self._jobs.pop(key, None)
        self._jobs[key] = job
        while len(self._jobs) > KEPT_JOBS:
            oldest = next(iter(self._jobs))
            if not self._jobs[oldest].done.is_set():
                break
            del self._jobs[oldest]
        return job

    def _run(self, job: _Job, handle: DirHandle) -> None:
        try:
            with handle:
                if job.kind == "checkpoint":
                    tables = sorted(self._write(handle))
                    _mark(handle, job.token, "complete", self._entries(), tables)
                    job.result = {"tables": tables}
                else:
                    job.result = {"tables": self._read(handle, job.options)}
        except BaseException as error:  # handed to the request that polls it
            job.error = error if isinstance(error, (ValueError, OSError)) else RuntimeError(
                f"{job.kind} of {job.shown!r} failed: {type(error).__name__}: {error}")
        finally:
            job.done.set()

    @staticmethod
    def _prepare(handle: DirHandle, token: str | None, entries: list[str]) -> bool:
        """Make `handle` ready for this request's checkpoint of `entries`; True when it holds
        that checkpoint complete already. Removes what an earlier, interrupted attempt of the
        same request wrote (its entries and their temporary names), nothing else."""
        names = [name for name in handle.names() if name != MARKER]
        marker = _read_marker(handle)
        if marker is None:
            if names:
                raise ValueError(f"meta 'directory' {handle.path!r} already exists and is not an empty directory; "
                                 f"a checkpoint goes to a new or empty one")
        elif marker.get("token") != token:
            raise ValueError(f"meta 'directory' {handle.path!r} holds another checkpoint (token "
                             f"{marker.get('token')!r:.140}); a checkpoint goes to a new or empty directory")
        elif marker.get("state") == "complete":
            return True
        else:  # this request's own partial output, left by a failed or interrupted attempt
            ours = {name for name in marker.get("entries", []) if isinstance(name, str)}
            for name in names:
                if name in ours or any(name.startswith(f".{entry}.tmp-") or name.startswith(f".{entry}.old-")
                                       for entry in ours):
                    handle.remove(name)
        _mark(handle, token, "writing", entries, [])
        return False


def _read_marker(handle: DirHandle) -> dict | None:
    if not handle.is_file(MARKER):
        return None
    try:
        marker = json.loads(handle.read_bytes(MARKER))
    except (OSError, ValueError):
        return {"token": object()}  # unreadable: nobody's, refused
    return marker if isinstance(marker, dict) else {"token": object()}


def _mark(handle: DirHandle, token: str | None, state: str, entries: list[str], tables: list[str]) -> None:
    handle.write_durably(MARKER, json.dumps({"token": token, "state": state, "entries": sorted(entries),
                                             "tables": tables}).encode())
