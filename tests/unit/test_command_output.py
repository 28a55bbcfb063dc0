"""What commands say while they run: progress lines when not on a terminal (rate and ETA counted
from after the first step, which compiles kernels), the launcher's relay of a leader trainer's
progress (a bar on a terminal, the lines as they are elsewhere), the strategy in words, the
compile notice, and the TensorBoard hint that names the extra to install."""
import io
import sys

from numba import njit

from hybridrec import kernel_cache
from hybridrec.config import parse_config
from hybridrec.parallel.progress_relay import ProgressRelay
from hybridrec.train.progress import ProgressLines, parse_progress_line
from hybridrec.train.reporting import Reporter
from hybridrec.train.summary import SUMMARY_KEYS, describe_strategy, summary_lines
from helpers import summary_of


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_lines_start_their_clock_after_the_first_step_and_read_back():
    out = io.StringIO()
    lines = ProgressLines(total=4, every_s=0.0, stream=out)
    lines.set_figures(loss="0.6931")
    for step in range(1, 5):
        lines.update(step, 100 * step)
    lines.close()
    printed = out.getvalue().splitlines()
    assert len(printed) == 4
    assert printed[0] == "progress: step 1/4 (25%), 100 samples, loss 0.6931"  # no rate, no ETA yet
    assert "samples/s, eta " in printed[1] and printed[3].startswith("progress: step 4/4 (100%), 400 samples, ")
    read = parse_progress_line(printed[3])
    assert read["step"] == 4 and read["total"] == 4 and read["rest"].startswith("400 samples, ")
    assert parse_progress_line("[ps0] listening") is None
    assert parse_progress_line("progress: step 7/?, 7 samples")["total"] is None


def test_the_launcher_passes_progress_through_as_lines_and_draws_a_bar_on_a_terminal():
    log = io.StringIO()
    relay = ProgressRelay(log)
    relay("nn", "progress: step 2/10 (20%), 512 samples")
    relay("ps0", "restarted")
    assert log.getvalue() == "[nn] progress: step 2/10 (20%), 512 samples\n[ps0] restarted\n"
    terminal = Terminal()
    relay = ProgressRelay(terminal)
    relay("nn", "progress: step 2/10 (20%), 512 samples, loss 0.5")
    relay("nn", "progress: step 5/10 (50%), 1,280 samples, loss 0.4")
    relay("ps0", "restarted")
    relay.close()
    shown = terminal.getvalue()
    assert "[nn] progress:" not in shown and "5/10" in shown and "loss 0.4" in shown and "[ps0] restarted" in shown


def test_the_strategy_and_the_summary_name_staleness_alike_for_every_strategy():
    het = parse_config({"strategy": {"preset": "het"}}).strategy.record()
    assert describe_strategy(het).startswith("het (placement ps, consistency het staleness=")
    result = {"strategy": het, "trainers": 2, "step": 3, "samples": 768, "train_samples_per_s": 1234.5,
              "auc": 0.75, "logloss": 0.5, "max_staleness": 23, "mean_staleness": 1.5}
    lines = summary_lines("launch", result, "runs/het")
    said = summary_of("\n".join(lines))
    assert set(SUMMARY_KEYS) <= set(said) and said["samples/s"] == "1,234"
    assert said["staleness"] == "max 23, mean 1.50 updates an embedding read missed"
    tasks = {key: value for key, value in result.items() if key != "auc"}
    said = summary_of("\n".join(summary_lines("train", {**tasks, "ctr/auc": 0.7, "cvr/auc": 0.6}, None)))
    assert said["test AUC"] == "ctr 0.70000, cvr 0.60000"  # a multi-task model: each task's


def test_compiling_a_kernel_is_said_once_per_process(monkeypatch, capsys):
    from numba.core import event

    # an announcer an earlier in-process command installed (a launch, say) stops listening while
    # this test installs its own, and listens again after it
    previous = kernel_cache._announcer
    if previous is not None:
        event.unregister("numba:compile", previous)
    monkeypatch.setattr(kernel_cache, "_announcer", None)
    kernel_cache.announce_compilation("hybridrec test")
    try:
        def twice(x):
            return 2 * x

        def thrice(x):
            return 3 * x

        for function in (twice, thrice):
            function.__module__ = "hybridrec.probe"  # only hybridrec's kernels are counted
        assert njit(twice)(2) == 4 and njit(thrice)(2) == 6
        err = capsys.readouterr().err
        assert err.count(kernel_cache.COMPILING) == 1 and "hybridrec test: compiling kernels" in err
        assert kernel_cache.compiled_kernels() == 2
    finally:
        event.unregister("numba:compile", kernel_cache._announcer)
        if previous is not None:
            event.register("numba:compile", previous)


def test_tensorboard_missing_names_the_extra_that_installs_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # importing it fails
    train = parse_config({"train": {"tensorboard": True, "progress": False}}).train
    with Reporter(tmp_path, train):
        pass
    assert "pip install 'hybridrec[tensorboard]'" in capsys.readouterr().err
