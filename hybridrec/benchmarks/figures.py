"""The PNG a bench writes for `--plot`: a headless matplotlib figure, laid out, saved and closed."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


@contextmanager
def png_figure(path: str, *args, **kwargs) -> Iterator[tuple]:
    """(figure, axes) of `plt.subplots(*args, **kwargs)` on the Agg backend; written to `path` when
    the block ends without an error, and closed either way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(*args, **kwargs)
    try:
        yield figure, axes
        figure.tight_layout()
        figure.savefig(path, dpi=110)
    finally:
        plt.close(figure)
