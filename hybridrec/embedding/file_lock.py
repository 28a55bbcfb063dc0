"""An exclusive lock on a file (flock), held by one owner at a time, that says who holds it when
taking it fails.

flock locks belong to an open file description, so a second `open` + flock of the same file
fails inside one process as it does across processes. The locks this process holds are kept in
a table by the file's (device, inode), so a refusal can say whether the holder is another owner
in this process (one that was never closed) or another process.
"""
from __future__ import annotations

import fcntl
import os

_HELD: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) of a lock file this process holds -> its pid


class LockHeld(Exception):
    """The lock is held elsewhere; `by_this_process` says whether by an owner in this process."""

    def __init__(self, path: str, by_this_process: bool):
        super().__init__(path)
        self.path, self.by_this_process = path, by_this_process


class ExclusiveLock:
    """flock(LOCK_EX) of the file at `path` (created when missing), taken without waiting:
    raises `LockHeld` when another open of it holds the lock. `release()` gives it back."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        info = os.fstat(self._fd)
        self._file = (info.st_dev, info.st_ino)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = -1
            raise LockHeld(self.path, _HELD.get(self._file) == os.getpid()) from None
        _HELD[self._file] = os.getpid()

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Give the lock back (nothing when already released)."""
        if self._fd < 0:
            return
        _HELD.pop(self._file, None)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = -1
