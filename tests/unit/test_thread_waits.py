"""Torch's OpenMP threads wait passively in every process that imports hybridrec first, unless the
user chose a policy (hybridrec.thread_waits)."""
import os
import subprocess
import sys

SHOW = "import hybridrec, torch, os; print(os.environ['OMP_WAIT_POLICY'])"


def _policy(**env) -> str:
    given = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", SHOW], env={**given, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip()


def test_threads_wait_passively_unless_the_user_set_a_policy():
    assert _policy() == "PASSIVE"
    assert _policy(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
