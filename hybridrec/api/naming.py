"""How a Python object the user hands to `hybridrec.api` is named in a config: the import path of a
class or function (`package.module:Name`, or `/abs/path/script.py:Name` for one defined in the
running script), and the directories the processes of a launched job need on PYTHONPATH to
import it."""
from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

from hybridrec.models.custom import is_import_path, remember


def import_path_of(obj) -> str | None:
    """The import path that names `obj` in every process (None: it has none, e.g. an instance, a
    class defined inside a function, or one typed into an interactive session). The path is
    remembered, so this process resolves it to `obj` itself without importing again."""
    if not (inspect.isclass(obj) or inspect.isfunction(obj)) or "<locals>" in obj.__qualname__:
        return None
    module = obj.__module__
    if module == "__main__":
        script = sys.modules["__main__"].__dict__.get("__file__")
        if not script or not script.endswith(".py"):
            return None
        path = f"{Path(script).resolve()}:{obj.__qualname__}"
    else:
        path = f"{module}:{obj.__qualname__}"
    remember(path, obj)
    return path


def package_root(path: str) -> str | None:
    """The directory to put on PYTHONPATH so that import path `path` ('package.module:Name')
    imports in another process as it did in this one (None for a file path, or a module this
    process has not imported)."""
    if not is_import_path(path):
        return None
    module_name = path.rpartition(":")[0]
    if module_name.endswith(".py") or module_name not in sys.modules:
        return None
    file = sys.modules[module_name].__dict__.get("__file__")
    if not file:
        return None
    source = Path(file).resolve()
    depth = module_name.count(".") + (1 if source.name == "__init__.py" else 0)
    return str(source.parents[depth])


def python_path_with(paths: list[str]) -> str:
    """PYTHONPATH with the import paths' package roots in front (those it lacks)."""
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    roots = [root for root in (package_root(p) for p in paths) if root and root not in current]
    return os.pathsep.join(dict.fromkeys(roots + current))
