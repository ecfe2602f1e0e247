"""Workers that finished their training exit with status 0: no abort at interpreter exit.

Regression test for the exit-time abort (``terminate called without an active exception``,
SIGABRT after the last step; see the docstring of :mod:`cannikin.runtime.comm`). The race
needs the backend thread to lag the main thread at exit, so the jobs run beside a process
that keeps one core busy. Before the fix, the worker script's 16 jobs lost 6 of 32 workers
to SIGABRT (with every one of its four endings) even without that process; 16 jobs pass by
chance at that rate with probability below 1e-2. After it: 0 of 80 workers in 40 jobs.
"""

import subprocess
import sys

from dist_utils import WORKERS, worker_env


def test_short_jobs_never_abort_at_exit() -> None:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        result = subprocess.run([sys.executable, str(WORKERS / "exit_worker.py"), "--jobs", "16"],
                                env=worker_env(), capture_output=True, text=True, timeout=240)
    finally:
        hog.kill()
        hog.wait()
    summary = [line for line in result.stdout.splitlines() if line.startswith("jobs ")]
    assert result.returncode == 0 and summary, result.stdout[-4000:] + result.stderr[-4000:]
    assert summary[0].endswith("aborted 0"), result.stdout[-4000:] + result.stderr[-4000:]
