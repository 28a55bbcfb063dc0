"""Runs the processes of one job on this machine and keeps them alive until the job ends.

Generic over what the processes are (`hybridrec launch` builds PS, embedding-worker and
torchrun roles; tests use small Python scripts). The contract:

* Service roles (`main=False`) start first, in order, each in its own session (process
  group), so stopping a role stops its whole tree. The main roles start once every service
  printed its `ready_marker`.
* Every line a role writes to stdout or stderr is copied to `out` as `[name] line`, by one
  thread per role; those threads are joined before `run` returns, so no line is lost. A
  `writer(name, line)` given instead writes each line itself (one at a time; `hybridrec launch`
  draws the leader trainer's progress lines as a bar on a terminal with it).
* A service that exits while the job runs (any exit code, or a signal such as SIGKILL) is
  started again with the same argv, at most `restarts` times; one more exit ends the job.
* The job succeeds when every main role exits 0. It fails when a main role exits non-zero, a
  service dies for good, or a role does not report ready within its `startup_timeout`.
* SIGINT / SIGTERM to this process (when `run` is called on the main thread), or `timeout`,
  end the job too. Every way out — including an exception in the supervisor itself — goes
  through `teardown`: SIGTERM to every role's process group, up to `grace` seconds, then
  SIGKILL to what is left. Roles also get SIGTERM from the kernel if the supervisor itself is
  killed with SIGKILL (PR_SET_PDEATHSIG), so no role outlives it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence, TextIO

from hybridrec.parallel.host import die_with_parent, proc_stat_fields

# exit codes of `Supervisor.run`
OK, FAILED, TIMED_OUT, INTERRUPTED = 0, 1, 124, 130


@dataclass
class Role:
    """One process of a job. `ready_marker`: a substring of the line the role prints once it
    serves (None: ready as soon as it started). `restarts`: how many times a service role is
    started again after it exits. `main`: the job ends when the main roles exit."""

    name: str
    argv: Sequence[str]
    ready_marker: str | None = None
    restarts: int = 0
    main: bool = False
    env: Mapping[str, str] | None = None
    startup_timeout: float = 180.0


@dataclass
class _Running:
    role: Role
    process: subprocess.Popen
    reader: threading.Thread | None = None
    ready: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'signal SIGKILL' for a Popen returncode."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is in process group `pgid`."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: ask the kernel whether the group exists at all
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        fields = proc_stat_fields(entry.name)
        if fields is not None and len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


class Supervisor:
    """Starts `roles`, streams their output, restarts services, and tears everything down.

    `run()` returns OK, FAILED, TIMED_OUT or INTERRUPTED; `reason` says why the job ended.
    `on_teardown` callbacks run after every process is gone (e.g. to delete shared memory).
    """

    def __init__(self, roles: Sequence[Role], *, out: TextIO | None = None, grace: float = 10.0,
                 prefix: str = "launch", poll_interval: float = 0.05,
                 writer: Callable[[str, str], None] | None = None):
        names = [r.name for r in roles]
        if len(set(names)) != len(names):
            raise ValueError(f"role names must be unique, got {names}")
        if not any(r.main for r in roles):
            raise ValueError("at least one role must be main=True (the job ends when the main roles exit)")
        self.roles = list(roles)
        self.out = out if out is not None else sys.stdout
        self.writer = writer
        self.grace = grace
        self.prefix = prefix
        self.poll_interval = poll_interval
        self.reason = ""
        self.on_teardown: list[Callable[[], None]] = []
        self._running: dict[str, _Running] = {}
        self._restarts_used = {r.name: 0 for r in roles}
        self._finished: dict[str, int] = {}  # main role -> return code
        self._retired: list[_Running] = []   # exited processes whose reader may still be draining
        self._lock = threading.Lock()
        self._signal: int | None = None

    # ------------------------------------------------------------------------------ output
    def emit(self, name: str, line: str) -> None:
        with self._lock:
            try:
                if self.writer is not None:
                    self.writer(name, line)
                    return
                self.out.write(f"[{name}] {line}\n")
                self.out.flush()
            except (ValueError, OSError):  # our own stdout closed: keep supervising
                pass

    def log(self, message: str) -> None:
        self.emit(self.prefix, message)

    def pids(self) -> dict[str, int]:
        """The pid of each running role (tests use it to check nothing survives)."""
        return {name: r.process.pid for name, r in self._running.items()}

    def _pump(self, running: _Running) -> None:
        marker, stream = running.role.ready_marker, running.process.stdout
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self.emit(running.role.name, line)
            if marker is not None and marker in line:
                running.ready.set()
        stream.close()

    # ------------------------------------------------------------------------- processes
    def _start(self, role: Role) -> _Running:
        env = dict(os.environ if role.env is None else role.env)
        env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach us as they are printed
        process = subprocess.Popen(list(role.argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                   preexec_fn=die_with_parent)
        running = _Running(role, process)
        running.reader = threading.Thread(target=self._pump, args=(running,), daemon=True,
                                          name=f"{self.prefix}-{role.name}")
        running.reader.start()
        if role.ready_marker is None:
            running.ready.set()
        self._running[role.name] = running
        return running

    def add_service(self, role: Role) -> threading.Event:
        """Start one more service role while the job runs (a PS server added by `hybridrec
        scale`); it is restarted and stopped like the others. Returns the event set once it
        printed its ready marker."""
        if role.main or role.name in self._restarts_used:
            raise ValueError(f"add_service takes a new service role, got {role.name!r}")
        self._restarts_used[role.name] = 0
        self.roles.append(role)
        return self._start(role).ready

    def retire(self, name: str) -> None:
        """Stop service role `name` for good while the job runs (a PS server that `hybridrec
        scale` emptied): SIGTERM, then SIGKILL after `grace` seconds; it is not restarted."""
        running = self._running.pop(name, None)
        if running is None:
            return
        self.roles = [role for role in self.roles if role.name != name]
        try:
            os.killpg(running.process.pid, signal.SIGTERM)
            running.process.wait(self.grace)
        except subprocess.TimeoutExpired:
            os.killpg(running.process.pid, signal.SIGKILL)
            running.process.wait(5)
        except ProcessLookupError:
            pass
        self._retired.append(running)
        self.log(f"{name} retired")

    def _exited(self, running: _Running) -> int | None:
        """The role's return code once its process exited, after killing what is left of its
        group (the leader is reaped only then, so its pid, which names the group, is not reused)."""
        pid = running.process.pid
        if running.process.returncode is None:
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                info = True  # already reaped elsewhere: poll() below knows the code
            if info is None:
                return None
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        returncode = running.process.poll()
        if returncode is not None:
            self._retired.append(running)
        return returncode

    def _check_services(self) -> bool:
        """Restart services that exited; False (with `reason`) once one exceeded its restarts."""
        for name, running in list(self._running.items()):
            role = running.role
            if role.main:
                continue
            returncode = self._exited(running)
            if returncode is None:
                continue
            del self._running[name]
            used = self._restarts_used[name]
            if used >= role.restarts:
                self.reason = (f"{name} died ({describe_exit(returncode)}) after {used} restart(s) "
                               f"of the {role.restarts} allowed")
                return False
            self._restarts_used[name] = used + 1
            self.log(f"{name} exited ({describe_exit(returncode)}); restarting it "
                     f"({used + 1} of {role.restarts})")
            self._start(role)
        return True

    def _check_mains(self) -> bool | None:
        """True when every main role exited 0, False (with `reason`) when one failed, else None."""
        for name, running in list(self._running.items()):
            if not running.role.main:
                continue
            returncode = self._exited(running)
            if returncode is None:
                continue
            del self._running[name]
            self._finished[name] = returncode
            if returncode != 0:
                self.reason = f"{name} failed ({describe_exit(returncode)})"
                return False
            self.log(f"{name} finished ({describe_exit(returncode)})")
        return True if all(r.name in self._finished for r in self.roles if r.main) else None

    # ------------------------------------------------------------------------------- run
    def _handle_signal(self, signum, frame) -> None:
        if self._signal is None:
            self._signal = signum

    def run(self, timeout: float | None = None) -> int:
        on_main = threading.current_thread() is threading.main_thread()
        previous = {}
        if on_main:
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous[signum] = signal.signal(signum, self._handle_signal)
        try:
            code = self._supervise(timeout)
        except BaseException as exc:
            self.reason = f"the supervisor failed: {exc!r}"
            self.log(self.reason)
            raise
        finally:
            self.teardown()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        self.log(("job finished: " if code == OK else "job failed: ") + self.reason)
        return code

    def _supervise(self, timeout: float | None) -> int:
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        services = [r for r in self.roles if not r.main]
        for role in services:
            self._start(role)
        phase = "startup"
        while True:
            if self._signal is not None:
                self.reason = f"stopped by {signal.Signals(self._signal).name}"
                return INTERRUPTED
            if deadline is not None and time.monotonic() >= deadline:
                self.reason = f"the job ran past its timeout of {timeout:g}s"
                return TIMED_OUT
            if not self._check_services():
                return FAILED
            if phase == "startup":
                waiting = [r for r in self._running.values() if not r.ready.is_set()]
                late = [r for r in waiting if time.monotonic() - r.started > r.role.startup_timeout]
                if late:
                    self.reason = (f"{late[0].role.name} did not report ready "
                                   f"({late[0].role.ready_marker!r}) within {late[0].role.startup_timeout:g}s")
                    return FAILED
                if not waiting:
                    if services:
                        self.log(f"{', '.join(r.name for r in services)} ready after "
                                 f"{time.monotonic() - start:.1f}s; starting "
                                 f"{', '.join(r.name for r in self.roles if r.main)}")
                    for role in self.roles:
                        if role.main:
                            self._start(role)
                    phase = "running"
            else:
                done = self._check_mains()
                if done is not None:
                    if done:
                        self.reason = "every main role exited 0"
                    return OK if done else FAILED
            time.sleep(self.poll_interval)

    def teardown(self) -> None:
        """Stop every role's process group (SIGTERM, `grace` seconds, SIGKILL), drain their
        output, then run the `on_teardown` callbacks. Safe to call more than once."""
        running = list(self._running.values())
        self._running.clear()
        for r in running:
            if r.process.poll() is None or _group_alive(r.process.pid):
                try:
                    os.killpg(r.process.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(
                r.process.poll() is None or _group_alive(r.process.pid) for r in running):
            time.sleep(self.poll_interval)
        for r in running:
            if r.process.poll() is None or _group_alive(r.process.pid):
                self.log(f"{r.role.name} (pid {r.process.pid}) did not stop within {self.grace:g}s "
                         "of SIGTERM; killing it")
                try:
                    os.killpg(r.process.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for r in running:
            try:
                r.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.log(f"{r.role.name} (pid {r.process.pid}) is still there after SIGKILL")
        for r in running + self._retired:
            if r.reader is not None:
                r.reader.join(timeout=5)  # EOF once every process holding the pipe is gone
        self._retired.clear()
        callbacks, self.on_teardown = self.on_teardown, []
        for callback in callbacks:
            try:
                callback()
            except Exception as exc:  # one failed clean-up must not skip the others
                self.log(f"clean-up failed: {exc!r}")
