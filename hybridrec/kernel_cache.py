"""Where numba keeps hybridrec's compiled kernels, so that a cached kernel always matches the source.

numba's on-disk cache checks only the modification time of the file that defines a kernel, not
of the files whose functions it inlines: after `git pull` changed kernels.py but not
group_kernels.py, the group kernels would load the old, inlined probe from the cache and run
it silently. Here the cache directory is named after a hash of every hybridrec source file, so
any change to the package compiles afresh. A NUMBA_CACHE_DIR set by the user is left alone (then
numba's own rule applies). The directory is ~/.cache/hybridrec/numba/<hash> (XDG_CACHE_HOME is
honoured), or the temporary directory when the home is not writable.

`announce_compilation()` makes a process say "compiling kernels (first run only)" on stderr when
numba starts compiling a hybridrec kernel that the cache did not hold (numba's `numba:compile` event, which
a kernel loaded from the cache does not fire), once per process; `compiled_kernels()` counts the
kernels it compiled, so a second run with the same sources can be seen to compile none.
"""
from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent
COMPILING = "compiling kernels (first run only)"
_announcer = None


def source_hash(root: Path = PACKAGE_ROOT) -> str:
    """A digest of the names and contents of every .py file under `root`."""
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def cache_dir(root: Path = PACKAGE_ROOT) -> Path:
    """The kernel cache directory for the sources under `root` (created)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridrec" / "numba"
    digest = source_hash(root)
    for parent in (base, Path(tempfile.gettempdir()) / "hybridrec-numba"):
        path = parent / digest
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    raise OSError(f"no writable directory for numba's kernel cache under {base} or the temporary directory")


def configure() -> str | None:
    """Point numba's cache at `cache_dir()` unless NUMBA_CACHE_DIR is set; returns the directory used."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return os.environ["NUMBA_CACHE_DIR"]
    try:
        import numba
    except ImportError:  # numba is a dependency; without it nothing compiles anyway
        return None
    try:
        path = str(cache_dir())
    except OSError:
        return None  # numba then caches next to the sources, as by default
    numba.config.CACHE_DIR = path
    return path


def announce_compilation(prefix: str = "hybridrec") -> None:
    """Say `COMPILING` on stderr when this process starts compiling a kernel (see the module doc);
    installing it again changes nothing."""
    global _announcer
    if _announcer is not None:
        return
    try:
        from numba.core import event
    except ImportError:
        return

    class Announcer(event.Listener):
        def __init__(self) -> None:
            self.compiled = 0

        def on_start(self, ev) -> None:
            function = getattr(ev.data["dispatcher"], "py_func", None)
            if not getattr(function, "__module__", "").startswith("hybridrec"):
                return  # numba's own helpers, compiled inside one of ours
            if self.compiled == 0:
                where = os.environ.get("NUMBA_CACHE_DIR") or _numba_cache_dir()
                _say(f"{prefix}: {COMPILING}; the compiled kernels are kept in {where} for the next run")
            self.compiled += 1

        def on_end(self, ev) -> None:
            pass

    _announcer = Announcer()
    event.register("numba:compile", _announcer)


def compiled_kernels() -> int:
    """Kernels this process compiled since `announce_compilation()` (0 before it)."""
    return 0 if _announcer is None else _announcer.compiled


def _numba_cache_dir() -> str:
    import numba

    return numba.config.CACHE_DIR or "numba's default place (next to the sources)"


def _say(text: str) -> None:
    """A line on stderr that does not garble a progress bar drawn there."""
    try:
        from tqdm import tqdm

        tqdm.write(text, file=sys.stderr)
    except ImportError:
        print(text, file=sys.stderr, flush=True)
