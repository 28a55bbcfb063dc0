"""`--ray ADDRESS` on the benches that run distributed jobs: every job goes through
`hybridrec launch`'s own entry (hybridrec.parallel.launch.launch) with that address, the launcher
`hybridrec launch --ray` uses, never a copy of it (fake launches, no job runs); an address other
than auto with emulated hosts is a one-line error before any job."""
from __future__ import annotations

import pytest

from hybridrec.benchmarks import des, het, ht, hybrid, picasso, speedups

ADDRESS = "127.0.0.1:6379"
SMALL = ["--set", "data.synthetic.train_rows=8192", "--set", "data.synthetic.test_rows=1000"]
BENCHES = {
    "hybrid": (hybrid.main, ["--runs", "1"]),
    "het": (het.main, ["--runs", "1", "--repeats", "1", "--no-persia", *SMALL]),
    "picasso": (picasso.main, ["--variants", "sharded", "--fields", "26"]),
    "des": (des.main, ["--skip-quality", "--models", "lr", "--batches", "512"]),
    "ht": (ht.main, ["--runs", "1", "--codecs", ""]),
    "speedups": (speedups.main, ["--runs", "1", "--strategies", "des", "--no-warmup"]),
}


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_job_of_a_bench_is_launched_on_the_ray_cluster_it_names(name, monkeypatch, capsys):
    calls = []

    def fake_launch(config, *, ray=None, **kwargs):
        calls.append(ray)
        return 1  # the first job fails: the bench stops there, with the launcher's exit code

    monkeypatch.setattr("hybridrec.parallel.launch.launch", fake_launch)
    main, argv = BENCHES[name]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--ray", ADDRESS])
    assert exit_info.value.code == 1 and "exited with code 1" in capsys.readouterr().err
    assert calls == [ADDRESS]


def test_an_address_with_emulated_hosts_is_refused_before_any_job(monkeypatch, capsys):
    monkeypatch.setattr("hybridrec.parallel.launch.launch", lambda *a, **k: pytest.fail("a job ran"))
    with pytest.raises(SystemExit) as exit_info:
        speedups.main(["--ray", ADDRESS, "--emulate-hosts", "2", "--bandwidth", "1gbit"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and err[-1].endswith(
        f"error: --ray {ADDRESS} with --emulate-hosts: the emulated hosts get a Ray cluster of their own; "
        "allowed: --ray auto")
