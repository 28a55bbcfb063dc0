"""Tests of `hybridrec launch` and the supervisor under it, driven by small real Python processes
as roles: unrecoverable deaths tear the job down, a SIGKILLed service comes back, every line is
prefixed and none is lost, SIGINT / --timeout stop whole process trees, the command refuses
configs and counts it cannot run, and the torchrun rendezvous never gets a server's port. (The
end-to-end job with real PS / embedding workers / trainers is tested where those programs live.)"""
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hybridrec.cli import main
from hybridrec.comm.auth import AUTH_KEY_ENV, AUTH_KEY_FILE_ENV, AuthError, JobKey
from hybridrec.embedding.memory import shm_path
from hybridrec.parallel import host as host_module
from hybridrec.parallel.host import (free_ports, new_job_id, ps_shm_name, remove_dead_jobs_shared_memory,
                                     remove_shared_memory)
from hybridrec.parallel.launch import launch
from hybridrec.parallel.roles import build_roles
from hybridrec.parallel.supervisor import FAILED, INTERRUPTED, OK, TIMED_OUT, Role, Supervisor
from hybridrec.ps import PSClient
from hybridrec.ps.server import listening_address
from helpers import JOB_SECONDS, job_shared_memory, processes_with, start_launch, trained_steps, wait_for, write_config

PY = sys.executable
# A service: starts a grandchild (so teardown must reach the whole tree), says where both are,
# reports ready and sleeps; it stops by itself after 60 s whatever happens.
SERVICE = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(f"svc pid {os.getpid()} child {child.pid}", flush=True)
    print("svc listening on tcp://127.0.0.1:1", flush=True)
    time.sleep(60)
""")


class Lines:
    """A thread-safe text sink that keeps the lines written to it."""

    def __init__(self):
        self.text, self.lock = "", threading.Lock()

    def write(self, s):
        with self.lock:
            self.text += s

    def flush(self):
        pass

    def lines(self):
        with self.lock:
            return self.text.splitlines()

    def wait_for(self, predicate, timeout=60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.lines() if predicate(line)]
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"no such line within {timeout}s; output:\n" + "\n".join(self.lines()))


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rfind(")") + 2] != "Z"


def service_pids(lines):
    """(pid, grandchild pid) of every service start that printed its pids."""
    return [(int(w[w.index("pid") + 1]), int(w[w.index("child") + 1]))
            for w in (line.split() for line in lines) if "child" in w]


def wait_gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_a_service_that_keeps_dying_fails_the_job_and_everything_else_is_stopped():
    out = Lines()
    roles = [Role("good", [PY, "-c", SERVICE], ready_marker=" listening on ", restarts=3),
             Role("bad", [PY, "-c", "import sys; print('dying', flush=True); sys.exit(3)"],
                  ready_marker=" listening on ", restarts=2),
             Role("main", [PY, "-c", "import time; time.sleep(60)"], main=True)]
    supervisor = Supervisor(roles, out=out, grace=5)
    assert supervisor.run(timeout=60) == FAILED
    assert "bad died (exit code 3) after 2 restart(s)" in supervisor.reason
    lines = out.lines()
    assert sum("bad exited (exit code 3); restarting it" in line for line in lines) == 2
    assert sum(line == "[bad] dying" for line in lines) == 3
    assert not any(line.startswith("[main]") for line in lines)  # never started: a service never got ready
    pids = [p for pair in service_pids(lines) for p in pair]
    assert len(pids) == 2 and wait_gone(pids) == []


def test_a_service_killed_with_sigkill_comes_back_and_the_job_still_succeeds(tmp_path):
    out, go = Lines(), tmp_path / "go"
    main_role = (f"import os, sys, time\nfor _ in range(600):\n    if os.path.exists({str(go)!r}): sys.exit(0)\n"
                 "    time.sleep(0.1)\nsys.exit(5)")
    roles = [Role("svc", [PY, "-c", SERVICE], ready_marker=" listening on ", restarts=1),
             Role("main", [PY, "-c", main_role], main=True)]
    supervisor = Supervisor(roles, out=out, grace=5)
    cleaned = []
    supervisor.on_teardown.append(lambda: cleaned.append(True))
    result = {}
    runner = threading.Thread(target=lambda: result.setdefault("code", supervisor.run(timeout=90)))
    runner.start()
    try:
        out.wait_for(lambda line: "starting main" in line)
        (first, first_child), = service_pids(out.lines())
        os.kill(first, signal.SIGKILL)
        out.wait_for(lambda line: "svc exited (signal SIGKILL); restarting it (1 of 1)" in line)
        out.wait_for(lambda line: len(service_pids(out.lines())) == 2)
        assert wait_gone([first_child]) == []  # the dead service's tree went with it
        go.touch()
    finally:
        runner.join(120)
    assert result["code"] == OK, out.lines()
    assert cleaned == [True]
    assert wait_gone([p for pair in service_pids(out.lines()) for p in pair]) == []


def test_every_line_carries_its_role_prefix_and_none_is_lost_at_exit():
    out = Lines()
    chatty = ("import sys\nfor i in range(2000):\n    print(f'line {i}')\n"
              "print('to stderr', file=sys.stderr)\nsys.stdout.write('no newline at the end')")
    roles = [Role("svc", [PY, "-c", "import time; print('a'); print('svc listening on x', flush=True); "
                                    "time.sleep(60)"], ready_marker=" listening on "),
             Role("nn", [PY, "-c", chatty], main=True)]
    assert Supervisor(roles, out=out, grace=5, prefix="launch").run(timeout=60) == OK
    lines = out.lines()
    assert all(line.startswith(("[svc] ", "[nn] ", "[launch] ")) for line in lines), lines
    nn = [line for line in lines if line.startswith("[nn] ")]
    assert nn[:2000] == [f"[nn] line {i}" for i in range(2000)]
    assert set(nn[2000:]) == {"[nn] to stderr", "[nn] no newline at the end"}
    assert "[svc] a" in lines


def test_a_main_role_that_fails_fails_the_job_naming_it():
    roles = [Role("svc", [PY, "-c", "import time; time.sleep(60)"]),
             Role("nn", [PY, "-c", "import sys; sys.exit(7)"], main=True)]
    supervisor = Supervisor(roles, out=Lines(), grace=5)
    assert supervisor.run(timeout=60) == FAILED
    assert supervisor.reason == "nn failed (exit code 7)"


def test_a_role_that_never_reports_ready_fails_the_job():
    roles = [Role("svc", [PY, "-c", "import time; time.sleep(60)"], ready_marker="listening", startup_timeout=1),
             Role("nn", [PY, "-c", "pass"], main=True)]
    supervisor = Supervisor(roles, out=Lines(), grace=5)
    assert supervisor.run(timeout=60) == FAILED
    assert "svc did not report ready ('listening') within 1s" in supervisor.reason


def test_timeout_stops_a_job_that_would_hang():
    out = Lines()
    roles = [Role("svc", [PY, "-c", SERVICE], ready_marker=" listening on "),
             Role("nn", [PY, "-c", "import time; time.sleep(60)"], main=True)]
    supervisor = Supervisor(roles, out=out, grace=5)
    started = time.monotonic()
    assert supervisor.run(timeout=3) == TIMED_OUT
    assert time.monotonic() - started < 30
    assert "timeout of 3s" in supervisor.reason
    assert wait_gone([p for pair in service_pids(out.lines()) for p in pair]) == []


def test_sigint_to_the_supervisor_process_stops_every_process_tree(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from hybridrec.parallel.supervisor import Role, Supervisor
        SERVICE = {SERVICE!r}
        roles = [Role("s0", [sys.executable, "-c", SERVICE], ready_marker=" listening on "),
                 Role("s1", [sys.executable, "-c", SERVICE], ready_marker=" listening on "),
                 Role("nn", [sys.executable, "-c", SERVICE], main=True)]
        sys.exit(Supervisor(roles, grace=5).run(timeout=90))
    """))
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    job = subprocess.Popen([PY, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        deadline = time.monotonic() + 90
        while len(service_pids(lines)) < 3 and time.monotonic() < deadline:
            if select.select([job.stdout], [], [], 1)[0]:
                lines.append(job.stdout.readline())
                if not lines[-1]:
                    break  # the job ended early; the assertion below shows what it said
        assert len(service_pids(lines)) == 3, lines
        job.send_signal(signal.SIGINT)
        rest, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)
    assert job.returncode == INTERRUPTED
    assert "stopped by SIGINT" in rest
    assert wait_gone([p for pair in service_pids(lines) for p in pair]) == []


def test_the_roles_follow_the_command_contract():
    plan = build_roles("job.yaml", ps=2, embedding_workers=2, trainers=3, overrides=["train.max_steps=5"],
                       job="j1", resume=True, max_restarts=2, role_restarts=4)
    assert [r.name for r in plan.roles] == ["ps0", "ps1", "ew0", "ew1", "nn"]
    assert plan.shm_names == ["hybridrec-j1-ps0", "hybridrec-j1-ps1"]
    ports = [a.rsplit(":", 1)[1] for a in plan.ps_addresses + plan.embedding_worker_addresses]
    assert len(set(ports)) == 4
    ps1 = plan.roles[1]
    assert ps1.argv[1:] == ["-m", "hybridrec.cli", "serve-ps", "--config", "job.yaml", "--set", "train.max_steps=5",
                            "--host", "127.0.0.1", "--port", ports[1], "--shm-name", "hybridrec-j1-ps1"]
    assert (ps1.restarts, ps1.main, ps1.ready_marker) == (4, False, "hybridrec-ps listening on ")
    ew1 = plan.roles[3]
    assert ew1.argv[1:] == ["-m", "hybridrec.cli", "embedding-worker", "job.yaml", "--set", "train.max_steps=5",
                            "--rank", "1", "--ps", ",".join(plan.ps_addresses), "--host", "127.0.0.1",
                            "--port", ports[3]]
    nn = plan.roles[4]
    assert nn.main and nn.argv[1:9] == ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "3",
                                        "--max-restarts", "2"]
    assert nn.argv[-9:] == ["hybridrec.parallel.trainer", "job.yaml", "--set", "train.max_steps=5", "--ps",
                            ",".join(plan.ps_addresses), "--embedding-workers",
                            ",".join(plan.embedding_worker_addresses), "--resume"]


def test_the_jobs_shared_memory_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDREC_SHM_DIR", str(tmp_path))
    prefix = ps_shm_name("j2", 0)
    for table in ("C1", "C2", "C1:wide"):
        (tmp_path / f"hybridrec-{prefix}.{table}").mkdir()
    (tmp_path / "hybridrec-other.C1").mkdir()
    remove_shared_memory([prefix], ["C1", "C2", "C1:wide"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hybridrec-other.C1"]


def job_sets(job, tables=("C1", "C1:wide")):
    """The shared memory a launcher's PS servers make for `job` (2 servers), as real directories."""
    sets = []
    for i in range(2):
        prefix = ps_shm_name(job, i)
        for name in (prefix, *(f"{prefix}.{t.replace(':', '..')}" for t in tables)):
            path = shm_path(name)
            path.mkdir()
            (path / "store.json").write_text("{}")
            sets.append(path)
    return sets


def dead_launcher_job():
    """A job id of a launcher that has exited: a child process's identity, taken while it ran."""
    child = subprocess.Popen([PY, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    stat = Path(f"/proc/{child.pid}/stat").read_text()
    start = stat[stat.rfind(")") + 2:].split()[19]
    child.communicate(b"")
    own = new_job_id().split("-")  # this process: pid, start, namespace tag, random
    return f"{child.pid}-{start}-{own[2]}-0d0d0d"


needs_proc = pytest.mark.skipif(new_job_id().count("-") != 3, reason="job ids carry no launcher identity "
                                                                       "without /proc")


@needs_proc
def test_the_shared_memory_of_a_dead_launcher_is_removed_and_live_or_foreign_sets_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDREC_SHM_DIR", str(tmp_path))
    live = new_job_id()  # this test process poses as a running launcher
    pid, start, tag, _ = live.split("-")
    dead = dead_launcher_job()
    reused = f"{pid}-{int(start) + 1}-{tag}-1e1e1e"  # this pid, but another process's start time
    elsewhere = f"{dead.split('-')[0]}-{start}-{'0' if tag[0] != '0' else '1'}{tag[1:]}-2f2f2f"  # other namespace
    dead_sets, reused_sets = job_sets(dead), job_sets(reused)
    kept = job_sets(live) + job_sets(elsewhere) + job_sets(f"{dead.split('-')[0]}-abcdef")  # old id format
    for name in ("mytable.C1", "job1-ps0", "job1-ps0.C1", f"hybridrec-{dead}-ps0-copy",
                 f"hybridrec-{dead}-psx", f"{dead}-ps0"):
        kept.append(shm_path(name))
        kept[-1].mkdir()
    (tmp_path / f"hybridrec-hybridrec-{dead}-ps7").write_text("a file, not a set")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / f"hybridrec-hybridrec-{dead}-ps8").symlink_to(tmp_path / "elsewhere")
    before = sorted(tmp_path.iterdir())

    logged = []
    removed = remove_dead_jobs_shared_memory(logged.append)
    assert sorted(removed) == sorted([(dead, p) for p in dead_sets] + [(reused, p) for p in reused_sets])
    assert logged == [f"removed shared memory of dead job {job}: {path}" for job, path in removed]
    assert sorted(tmp_path.iterdir()) == sorted(set(before) - set(dead_sets) - set(reused_sets))
    assert all(p.is_dir() for p in kept)
    assert remove_dead_jobs_shared_memory(logged.append) == [] and len(logged) == len(removed)  # silent now


def test_the_sweep_is_silent_when_there_is_nothing_to_remove(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDREC_SHM_DIR", str(tmp_path / "missing"))
    assert remove_dead_jobs_shared_memory(pytest.fail) == []
    monkeypatch.setenv("HYBRIDREC_SHM_DIR", str(tmp_path))
    shm_path("mytable.C1").mkdir()
    assert remove_dead_jobs_shared_memory(pytest.fail) == []


@needs_proc
def test_launch_removes_dead_jobs_memory_at_start_after_its_job_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDREC_SHM_DIR", str(tmp_path))
    dead = dead_launcher_job()
    dead_sets = job_sets(dead)
    monkeypatch.setattr(Supervisor, "run", lambda self, timeout=None: OK)  # no roles: only the start
    config = tmp_path / "job.yaml"
    config.write_text("strategy:\n  preset: persia\n")
    out = Lines()
    assert launch(str(config), ps=1, embedding_workers=1, trainers=1, out=out) == OK
    assert not any(p.exists() for p in dead_sets)
    lines = out.lines()
    assert lines[0].startswith("[launch] job ")
    assert lines[1:] == [f"[launch] removed shared memory of dead job {dead}: {p}" for p in sorted(dead_sets)]
    job = "\n".join(lines).split("[launch] job ", 1)[1].split(":", 1)[0]  # as tests/test_distributed.py reads it
    assert job.rsplit("-", 1)[0] == new_job_id().rsplit("-", 1)[0]  # launched by this process


def test_launch_refuses_a_local_strategy_config_naming_the_placement(tmp_path, capsys):
    config = tmp_path / "job.yaml"
    config.write_text("strategy:\n  preset: local\n")
    assert main(["launch", str(config), "--ps", "1", "--embedding-workers", "1", "--trainers", "1"]) == 2
    err = capsys.readouterr().err
    assert "strategy.placement is 'local'" in err and "--set strategy.preset=persia" in err


def test_launch_refuses_replicas_for_a_strategy_whose_server_state_they_would_not_copy(tmp_path, capsys):
    """HET's clocks live on the PS servers by index, outside the replicated buckets: a failover
    would lose them, so `ps_replicas: 2` is refused before anything starts."""
    config = tmp_path / "job.yaml"
    config.write_text("strategy:\n  preset: het\n  ps_replicas: 2\n")
    assert main(["launch", str(config), "--ps", "2", "--trainers", "1"]) == 2
    err = capsys.readouterr().err
    assert "strategy.ps_replicas is 2, but strategy.consistency het keeps state" in err and len(err.splitlines()) == 1


def test_launch_refuses_replicas_on_emulated_hosts_where_the_ps_tier_is_fixed(tmp_path, capsys):
    """On emulated hosts the PS servers are neither routed nor replicated: `ps_replicas: 2` there
    is refused before any namespace is made, not silently run without a backup."""
    config = tmp_path / "job.yaml"
    config.write_text("strategy:\n  preset: persia\n  ps_replicas: 2\n")
    assert main(["launch", str(config), "--ps", "2", "--trainers", "1", "--emulate-hosts", "2"]) == 2
    err = capsys.readouterr().err
    assert "strategy.ps_replicas is 2, but a job on emulated hosts" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("flags, message", [
    (["--ps", "0", "--embedding-workers", "1", "--nn-workers", "1"], "--ps must be at least 1, got 0"),
    (["--ps", "1", "--embedding-workers", "1", "--nn-workers", "1", "--timeout", "-1"], "--timeout must be positive"),
])
def test_launch_refuses_bad_counts_before_starting_anything(tmp_path, capsys, flags, message):
    config = tmp_path / "job.yaml"
    config.write_text("strategy:\n  preset: persia\n")
    assert main(["launch", str(config), *flags]) == 2
    assert message in capsys.readouterr().err


def test_ports_drawn_later_skip_the_ones_drawn_before(monkeypatch):
    """The kernel may hand a released port out again; the rendezvous port is drawn after the
    servers' ports were released, and must not be one of them (the torchrun agent would dial a
    PS server instead of its store)."""
    handed_out = iter([7001, 7002, 7001, 7002, 7003])

    class ReusingSocket:
        def __init__(self, *args):
            self.port = None

        def bind(self, address):
            self.port = next(handed_out)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            pass

    monkeypatch.setattr(host_module.socket, "socket", ReusingSocket)
    servers = free_ports(2)
    assert servers == [7001, 7002]
    assert free_ports(1, exclude=set(servers)) == [7003]


def test_every_role_dies_with_a_launcher_killed_with_sigkill(tmp_path):
    """`kill -9` of `hybridrec launch` once its trainers run: the kernel takes every role with it
    (the PS servers, the embedding worker, torchrun and the trainers under it), busy or not."""
    config = write_config(tmp_path, epochs=20)
    log = tmp_path / "launch.log"
    launcher = start_launch(config, log)
    try:
        wait_for(lambda: len(processes_with("hybridrec.parallel.trainer", str(config))) >= 3, JOB_SECONDS,
                 "torchrun and its 2 trainers", log)
        wait_for(lambda: trained_steps(tmp_path / "run") >= 1, JOB_SECONDS, "a first training step", log)
        roles = [pid for pid in processes_with(str(config)) if pid != launcher.pid]
        assert len(roles) >= 5, log.read_text()[-3000:]  # 2 PS, 1 embedding worker, torchrun, its 2 trainers
        launcher.send_signal(signal.SIGKILL)  # the launcher alone, not its process group
        launcher.wait(10)
        wait_for(lambda: not any(pid in roles for pid in processes_with(str(config))), 90,
                 "every role of the killed launcher to end", log)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        for pid in processes_with(str(config)):  # only if the test failed: leave nothing behind
            os.kill(pid, signal.SIGKILL)
    for path in job_shared_memory(log):  # as the next launch's sweep would
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("orphaned", [False, True])
def test_a_process_whose_parent_died_before_it_asked_to_die_with_it_ends_at_once(orphaned):
    """A trainer asks to die with torchrun's agent only after its slow imports; when the agent was
    killed meanwhile, the kernel will never signal it, so it signals itself."""
    script = textwrap.dedent(f"""
        import os, time
        from hybridrec.parallel.host import die_with_parent
        started_by = os.getppid()
        die_with_parent(parent=started_by + 1 if {orphaned} else started_by)
        time.sleep(2)
    """)
    child = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert child.returncode == (-signal.SIGTERM if orphaned else 0)


def test_a_launch_default_ps_refuses_a_client_without_the_job_key(tmp_path, monkeypatch):
    """On loopback too, the launchers give each job a key (Redis's protected mode is the model):
    another local process that does not have it is refused at the handshake."""
    for name in (AUTH_KEY_ENV, AUTH_KEY_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HYBRIDREC_SHM_DIR", str(tmp_path))
    config = write_config(tmp_path)
    plan = build_roles(str(config), ps=1, embedding_workers=0, trainers=1, checkpoint_root=str(tmp_path / "run"))
    ps0 = plan.roles[0]
    process = subprocess.Popen(ps0.argv, env=ps0.env, stdout=subprocess.PIPE, text=True)
    try:
        address = listening_address(process, ps0.ready_marker, "ps0", JOB_SECONDS)
        with pytest.raises(AuthError), PSClient([address], timeout=10, retries=0) as stranger:
            stranger.ping()
        key = JobKey.from_text(ps0.env[AUTH_KEY_ENV], "the job's key")
        with PSClient([address], timeout=10, retries=0, key=key) as member:  # a role of the job
            assert member.ping()[0]["pid"] == process.pid
    finally:
        process.terminate()
        process.wait(30)
        process.stdout.close()


def test_group_ps_roles_follow_the_groups_and_trainers_that_cannot_form_them_are_refused(tmp_path, capsys):
    config = tmp_path / "job.yaml"
    config.write_text("strategy:\n  preset: ht\n  roles: {trainers: 4}\n  ht: {groups: 2, group_ps: 2}\n")
    plan = build_roles(str(config), ps=1, embedding_workers=1, trainers=4, group_ps=(2, 2), job="j3")
    assert [r.name for r in plan.roles] == ["ps0", "ew0", "gp0", "gp1", "gp2", "gp3", "nn"]
    gp3 = plan.roles[5].argv
    assert gp3[3:5] == ["group-ps", str(config)] and gp3[gp3.index("--group") + 1] == "1"
    assert gp3[gp3.index("--index") + 1] == "1" and gp3[gp3.index("--trainers-per-group") + 1] == "2"
    nn = plan.roles[-1].argv
    assert nn[nn.index("--group-ps") + 1] == ",".join(plan.group_ps_addresses)  # the trainers only connect
    assert main(["launch", str(config), "--trainers", "3"]) == 2
    assert "--trainers 3: strategy.ht.groups 2 groups of equal size cannot be made of 3 trainers" in capsys.readouterr().err
