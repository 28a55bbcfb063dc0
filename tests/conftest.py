"""Test-suite setup: tests/ on sys.path (for the shared `helpers` module), and every test under
tests/distributed/ marked `distributed` (it starts servers, trainers or process groups), so
`pytest -m "not distributed"` runs the unit tests alone."""
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if TESTS / "distributed" in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.distributed)
