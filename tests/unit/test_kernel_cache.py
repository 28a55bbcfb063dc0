"""The kernel cache directory follows the sources: any edit of any module compiles afresh."""
import numba

from hybridrec import kernel_cache


def _package(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_an_edit_to_any_module_changes_the_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = _package(tmp_path / "pkg", {"kernels.py": "A = 1\n", "sub/group.py": "from kernels import A\n"})
    first = kernel_cache.cache_dir(root)
    assert first.is_dir() and first.parent == tmp_path / "cache" / "hybridrec" / "numba"
    assert kernel_cache.cache_dir(root) == first  # same sources, same directory
    (root / "kernels.py").write_text("A = 2\n")  # only the inlined module changes
    assert kernel_cache.cache_dir(root) != first


def test_a_user_cache_dir_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "mine"))
    assert kernel_cache.configure() == str(tmp_path / "mine")
    assert numba.config.CACHE_DIR == str(tmp_path / "mine")


def test_without_a_user_choice_numba_caches_under_the_source_hash(tmp_path, monkeypatch):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(numba.config, "CACHE_DIR", numba.config.CACHE_DIR)  # restored afterwards
    used = kernel_cache.configure()
    assert used == str(tmp_path / "cache" / "hybridrec" / "numba" / kernel_cache.source_hash())
    assert numba.config.CACHE_DIR == used
