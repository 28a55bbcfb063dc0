"""Tests of the benches' --plot output: each plot function writes a PNG from a report of the
shape its bench makes, and a failure while drawing leaves no file and no open figure."""
import matplotlib
import pytest

from hybridrec.benchmarks import het, ht, picasso
from hybridrec.benchmarks.figures import png_figure


def _is_png(path) -> bool:
    return path.read_bytes().startswith(b"\x89PNG")


def test_each_bench_plot_writes_a_png(tmp_path):
    het.plot({"miss_rate": {"lru": {"0.05": 0.3, "0.1": 0.2}, "lfu": {"0.05": 0.25, "0.1": 0.15}},
              "ns_per_read": {"lru": 40.0, "lfu": 45.0}, "settings": {"config": "configs/het_synthetic.yaml"}},
             str(tmp_path / "het.png"))
    report = {"easgd_4": {"curve": [(10, 0.5), (20, 0.45)], "samples_per_s": 1000.0},
              "ht_2x2": {"curve": [(10, 0.48), (20, 0.40)], "samples_per_s": None},
              "settings": {"trainers": 4, "runs": 1, "config": "configs/ht.yaml"}}
    ht.plot(report, ["easgd_4", "ht_2x2"], str(tmp_path / "ht.png"))
    picasso.plot({"26": {"sharded": 900.0, "picasso": 1200.0}, "52": {"sharded": 500.0, "picasso": 700.0}},
                 str(tmp_path / "picasso.png"), "fields")
    for name in ("het", "ht", "picasso"):
        assert _is_png(tmp_path / f"{name}.png"), name


def test_a_failure_while_drawing_writes_nothing_and_closes_the_figure(tmp_path):
    import matplotlib.pyplot as plt

    path = tmp_path / "broken.png"
    open_before = len(plt.get_fignums())
    with pytest.raises(KeyError):
        with png_figure(str(path), figsize=(4, 3)) as (_, axis):
            axis.plot([1, 2], [3, 4])
            raise KeyError("a report without the key the plot reads")
    assert not path.exists() and len(plt.get_fignums()) == open_before
    assert matplotlib.get_backend().lower() == "agg"
