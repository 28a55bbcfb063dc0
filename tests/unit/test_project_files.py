"""The repository works from any clone: no file names one machine's absolute paths (a home or
checkout directory), and every strategy preset has an example config in configs/ that loads,
named in the README's table of presets."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import hybridrec
from hybridrec.axes import PRESETS
from hybridrec.config import load_config

REPO = Path(hybridrec.__file__).resolve().parents[1]
# an absolute path into one machine's work or home directories (work, root, home/NAME or Users/NAME
# at the file system's root), not /tmp, /dev/shm or /proc, which every machine has
MACHINE_PATH = re.compile(rb"(?<![\w.~-])/(?:work|root|home/[\w.-]+|Users/[\w.-]+)/")
NOT_SOURCE = {".git", "__pycache__", ".pytest_cache", ".hypothesis", "runs", "build"}


def _project_files() -> list[Path]:
    """The files of the checkout that git would commit (tracked, or new and not ignored); every
    file but build and run output outside a git checkout."""
    try:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                                capture_output=True, check=True, timeout=60).stdout
        return [REPO / name for name in listed.decode().split("\0") if name and (REPO / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in REPO.rglob("*") if p.is_file() and not NOT_SOURCE & set(p.relative_to(REPO).parts)
                and not any(part.endswith(".egg-info") for part in p.parts)]


def test_no_file_names_a_machines_absolute_paths():
    files = _project_files()
    assert any(path.name == "README.md" for path in files)
    found = []
    for path in files:
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            match = MACHINE_PATH.search(line)
            if match:
                found.append(f"{path.relative_to(REPO)}:{number}: {match.group().decode(errors='replace')}")
    assert not found, "absolute machine paths (use paths relative to the repository root):\n" + "\n".join(found)


def test_the_pattern_finds_machine_paths_and_leaves_portable_ones():
    root = b"/"  # kept apart so that this file does not hold the paths it looks for
    for text in (b"cd " + root + b"work/main && hybridrec train", b"data: " + root + b"root/data.tsv",
                 b"(" + root + b"home/alice/x)", root + b"Users/bob/c"):
        assert MACHINE_PATH.search(text), text
    for text in (b"/tmp/synth.tsv", b"/dev/shm/store", b"../shared/data/x.tsv", b"~/work/x", b"a/work/b", b"/homework/"):
        assert not MACHINE_PATH.search(text), text


def _readme_preset_rows() -> dict[str, str]:
    """preset -> its row in the README's table of presets (a row starting with | `preset` |)."""
    rows = {}
    for line in (REPO / "README.md").read_text().splitlines():
        match = re.match(r"\| `(\w+)`", line)
        if match and match.group(1) in PRESETS:
            rows[match.group(1)] = line
    return rows


@pytest.mark.parametrize("preset", sorted(name for name, axes in PRESETS.items() if axes))
def test_every_preset_has_a_config_that_loads_named_in_the_readme(preset):
    row = _readme_preset_rows().get(preset)
    assert row, f"README.md has no row for preset {preset!r} (| `{preset}` | paper | config | ...)"
    configs = re.findall(r"configs/[\w.-]+\.yaml", row)
    assert configs, f"README.md's row of preset {preset!r} names no config: {row}"
    for config in configs:
        assert (REPO / config).is_file(), f"README.md names {config}, which does not exist"
        assert load_config(str(REPO / config)).strategy.record()["preset"] == preset, config


def _code_path(token: str, folder: Path | None) -> Path | None:
    """The file or folder a backticked README token names: `hybridrec/...` and `configs/...` from
    the repository root, `strategy/...` under hybridrec/, a bare `name.py` in the folder named
    last before it; None for other tokens."""
    if token.startswith(("hybridrec/", "configs/")):
        return REPO / token
    if token.startswith("strategy/"):
        return REPO / "hybridrec" / token
    if folder is not None and re.fullmatch(r"[\w.]+\.py", token):
        return folder / token
    return None


def test_every_file_the_readme_names_exists():
    """The README's map (paper -> preset -> files) and its configs stay true as code moves."""
    missing = []
    for line in (REPO / "README.md").read_text().splitlines():
        folder = None
        for token in re.findall(r"`([^`\s]+)`", line):
            path = _code_path(token.rstrip(":"), folder)
            if path is None or "<" in token or "*" in token:
                continue
            if not path.exists():
                missing.append(token)
            elif path.is_dir():
                folder = path
    assert not missing, f"README.md names files that do not exist: {missing}"


def _packages() -> set[str]:
    root = REPO / "hybridrec"
    return {p.name.removesuffix(".py") for p in root.iterdir()
            if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()}


def test_architecture_stands_alone_and_maps_every_package():
    """docs/architecture.md is the map of a clone: it names no guide or issue the clone does not
    have, and its layer table has a row for every top-level package."""
    text = (REPO / "docs" / "architecture.md").read_text()
    elsewhere = re.findall(r"DESIGN\.md|\.\./shared|\bissues? #?\d+|(?<![\w/])#\d+\b", text)
    assert not elsewhere, f"docs/architecture.md refers to what a clone does not have: {elsewhere}"
    mapped = set()
    for line in text.splitlines():
        match = re.match(r"\| \d+ \| (.+?) \|", line)
        if match:
            mapped.update(re.findall(r"`(\w+)`", match.group(1)))
    assert _packages() <= mapped, f"packages without a row in the map: {sorted(_packages() - mapped)}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than '-' and '_' dropped,
    spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text, anchors = page.read_text(), set()
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            anchors.add(_anchor(line.lstrip("#")))
    return anchors


def test_every_link_to_a_section_finds_its_heading():
    """Links like [x](#section) and [x](other.md#section) in the README and docs/ land on a heading."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            linked = (page.parent / target).resolve() if target else page
            if not linked.is_file() or anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(REPO)}: ({target}#{anchor})")
    assert not broken, "links to sections that do not exist:\n" + "\n".join(broken)


def test_no_two_test_files_share_a_name():
    # the test folders are not packages, so pytest imports each file under its base name: two files
    # of one name stop the whole suite at collection ("import file mismatch")
    names = [path.name for path in (REPO / "tests").rglob("test_*.py")]
    assert sorted(name for name in set(names) if names.count(name) > 1) == []
