"""Directories opened once and used by handle: files and subdirectories are created, read,
renamed and removed relative to an open directory descriptor (`openat` and friends: `dir_fd`,
`O_NOFOLLOW`), so that no rename of a path and no symlink swapped in afterwards can redirect
them elsewhere.

A checkpoint written or read through a `DirHandle` stays inside the directory the handle was
opened on: every name is one path component, a component that is a symlink is refused (never
followed), and what the handle refers to does not change when its path is renamed.
`Entry(parent, name)` names one entry of an open directory (a checkpoint directory to write or
read). Paths are still accepted everywhere (a local run), then opened following symlinks, as a
path given by the user is meant.
"""
from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from typing import BinaryIO

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW = os.O_NOFOLLOW


def check_name(name: str) -> str:
    """`name` if it is one path component (not '', '.', '..', nothing with '/' or NUL)."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"{name!r} is not a single file name")
    return name


class DirHandle:
    """An open directory; names given to its methods are entries of it (see the module
    docstring). Close it (or use it as a context manager) when done."""

    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path

    @classmethod
    def open(cls, path: str | os.PathLike, *, create: bool = False) -> "DirHandle":
        """The directory at `path` (symlinks in it followed, as a user's path means them);
        with `create`, made first with its missing parents."""
        path = os.fspath(path)
        if create:
            os.makedirs(path, exist_ok=True)
        return cls(os.open(path, _DIRECTORY), path)

    def __repr__(self) -> str:
        return f"DirHandle({self.path!r})"

    def __enter__(self) -> "DirHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def where(self, name: str) -> str:
        """A path naming entry `name`, for messages."""
        return os.path.join(self.path, name)

    # ---------------------------------------------------------------- directories
    def sub(self, name: str, *, create: bool = False) -> "DirHandle":
        """The subdirectory `name` (made when missing, with `create`); a symlink there is refused."""
        check_name(name)
        if create:
            try:
                os.mkdir(name, 0o755, dir_fd=self.fd)
            except FileExistsError:
                pass
        try:
            fd = os.open(name, _DIRECTORY | _NOFOLLOW, dir_fd=self.fd)
        except OSError as error:
            if self.is_symlink(name):
                raise NotADirectoryError(f"a symlink, {self.where(name)}") from None
            raise error
        return DirHandle(fd, self.where(name))

    def walk(self, parts: list[str], *, create: bool = False) -> "DirHandle":
        """The directory `parts` (components) below this one, each opened from the last."""
        handle = DirHandle(os.dup(self.fd), self.path)
        try:
            for part in parts:
                inner = handle.sub(part, create=create)
                handle.close()
                handle = inner
        except BaseException:
            handle.close()
            raise
        return handle

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def _stat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(check_name(name), dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        return self._stat(name) is not None

    def is_dir(self, name: str) -> bool:
        info = self._stat(name)
        return info is not None and stat.S_ISDIR(info.st_mode)

    def is_file(self, name: str) -> bool:
        info = self._stat(name)
        return info is not None and stat.S_ISREG(info.st_mode)

    def is_symlink(self, name: str) -> bool:
        info = self._stat(name)
        return info is not None and stat.S_ISLNK(info.st_mode)

    def size(self, name: str) -> int:
        info = self._stat(name)
        if info is None or not stat.S_ISREG(info.st_mode):
            raise FileNotFoundError(f"{self.where(name)} is not a file")
        return info.st_size

    # ---------------------------------------------------------------- files
    def open_file(self, name: str, mode: str = "rb") -> BinaryIO:
        """A file of this directory, never through a symlink: "rb", "wb" (created or truncated)
        or "xb" (created, must not exist)."""
        flags = {"rb": os.O_RDONLY, "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                 "xb": os.O_WRONLY | os.O_CREAT | os.O_EXCL}[mode]
        fd = os.open(check_name(name), flags | _NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=self.fd)
        return os.fdopen(fd, "rb" if mode == "rb" else "wb")

    def read_bytes(self, name: str) -> bytes:
        with self.open_file(name) as file:
            return file.read()

    def write_durably(self, name: str, data: bytes) -> None:
        """Write `name` whole or not at all: a temporary file, fsync, then a rename over it."""
        temporary = f".{name}.tmp-{os.getpid()}"
        with self.open_file(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        self.rename(temporary, name)

    def rename(self, source: str, target: str) -> None:
        """Rename entry `source` to `target` (replacing a file or an empty directory there)."""
        os.replace(check_name(source), check_name(target), src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def remove(self, name: str) -> None:
        """Remove entry `name` (a directory with everything in it, never following a symlink);
        nothing when it does not exist."""
        info = self._stat(name)
        if info is None:
            return
        if stat.S_ISDIR(info.st_mode):
            shutil.rmtree(name, dir_fd=self.fd)
        else:
            os.unlink(name, dir_fd=self.fd)

    def fsync(self) -> None:
        os.fsync(self.fd)


@dataclass(frozen=True)
class Entry:
    """Entry `name` of the open directory `parent`: where a checkpoint is written or read."""

    parent: DirHandle
    name: str

    def __str__(self) -> str:
        return self.parent.where(self.name)


def open_directory(target: "str | os.PathLike | Entry | DirHandle", *, create: bool = False) -> DirHandle:
    """A handle on `target`: a path (followed), an `Entry` (never through a symlink) or a
    handle (a new descriptor of the same directory). Close it when done."""
    if isinstance(target, DirHandle):
        return DirHandle(os.dup(target.fd), target.path)
    if isinstance(target, Entry):
        return target.parent.sub(target.name, create=create)
    return DirHandle.open(target, create=create)


def parent_and_name(target: "str | os.PathLike | Entry") -> tuple[DirHandle, str]:
    """(a handle on the directory that holds `target`, made when missing; its name there).
    Close the handle when done."""
    if isinstance(target, Entry):
        return DirHandle(os.dup(target.parent.fd), target.parent.path), check_name(target.name)
    path = os.path.abspath(os.fspath(target))
    parent, name = os.path.split(path.rstrip("/") or "/")
    return DirHandle.open(parent, create=True), check_name(name)
