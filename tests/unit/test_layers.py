"""The packages form layers with no back-and-forth (docs/architecture.md, "Map: the packages by layer"):
each imports only packages below it, lazy imports inside functions included."""
import ast
from pathlib import Path

import pytest

import hybridrec

ROOT = Path(hybridrec.__file__).parent
# lowest first; a package may import itself and the packages of the layers before its own
LAYERS = [{"mixing", "kernel_cache", "thread_waits", "metrics", "errors", "axes"}, {"data", "models"}, {"embedding", "des"}, {"comm"},
          {"config"}, {"job"}, {"bundle"}, {"het"}, {"ps"}, {"persia", "picasso", "hierarchical"}, {"strategy"}, {"train"},
          {"serving"}, {"parallel", "lab", "costs"}, {"benchmarks", "api"}, {"cli"}]
KNOWN: set = set()  # (file, package) edges allowed against the layers: none


def test_every_package_has_a_layer():
    packages = {p.name.removesuffix(".py") for p in ROOT.iterdir()
                if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()}
    assert packages == set().union(*LAYERS)


def _package(module: str) -> str:
    return module.split(".")[1] if module.startswith("hybridrec.") else ""


def _imported(path: Path) -> set[str]:
    """The hybridrec packages a file imports (top-level or inside functions)."""
    here = path.relative_to(ROOT.parent).with_suffix("").parts  # ("hybridrec", "embedding", "store")
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_package(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this file's package
                base = ".".join(here[:len(here) - node.level] + ((node.module,) if node.module else ()))
            else:
                base = node.module or ""
            found.add(_package(base))
    return found - {""}


def _allowed(package: str) -> set[str]:
    allowed = {package}
    for layer in LAYERS:
        if package in layer:
            return allowed
        allowed |= layer
    raise AssertionError(package)


@pytest.mark.parametrize("package", sorted(set().union(*LAYERS)))
def test_a_lower_package_imports_nothing_above_it(package):
    paths = [ROOT / f"{package}.py"] if (ROOT / f"{package}.py").exists() else sorted((ROOT / package).rglob("*.py"))
    wrong = []
    for path in paths:
        name = str(path.relative_to(ROOT))
        wrong += [f"{name} imports hybridrec.{p}" for p in sorted(_imported(path) - _allowed(package))
                  if (name, p) not in KNOWN]
    assert not wrong, "\n".join(wrong)


def test_the_store_and_its_checkpoint_format_do_not_import_each_other_back():
    assert "checkpoint" not in {n.module for n in ast.walk(ast.parse((ROOT / "embedding/store.py").read_text()))
                                if isinstance(n, ast.ImportFrom)}
    fmt = (ROOT / "embedding/checkpoint_format.py").read_text()
    assert "from .store" not in fmt and "import store" not in fmt


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in ROOT.rglob("*.py")}


def _imported_modules(path: Path) -> set[str]:
    """The hybridrec modules a file imports (top-level or inside functions): `from a.b import c`
    names module a.b.c when there is one, else a.b."""
    here = path.relative_to(ROOT.parent).with_suffix("").parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            base = (".".join(here[:len(here) - node.level] + ((node.module,) if node.module else ()))
                    if node.level else node.module or "")
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.add(name if name in MODULES else base)
    return (found & set(MODULES)) - {_module_name(path)}


def test_no_two_modules_import_each_other():
    """Within a layer too: e.g. the launchers (parallel/launch.py, emulated_hosts.py, ray_launch.py,
    ray_emulated.py) share their plumbing through parallel/host.py and parallel/roles.py."""
    imports = {name: _imported_modules(path) for name, path in MODULES.items()}
    both = sorted({tuple(sorted((a, b))) for a, targets in imports.items() for b in targets if a in imports.get(b, ())})
    assert not both, "\n".join(f"{a} <-> {b}" for a, b in both)


def test_the_launchers_do_not_import_one_another():
    launchers = {"launch", "emulated_hosts", "ray_launch", "ray_emulated"}
    edges = [(a, b) for a in launchers for b in launchers - {a}
             if f"hybridrec.parallel.{b}" in _imported_modules(ROOT / "parallel" / f"{a}.py")]
    allowed = {("launch", "emulated_hosts"), ("launch", "ray_launch"), ("ray_launch", "ray_emulated"),
               ("ray_emulated", "emulated_hosts")}  # launch(ray=...): the one entry of every launcher
    assert set(edges) <= allowed, edges  # one way only: each dispatches to the one it runs on
