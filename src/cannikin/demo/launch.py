"""Start a local cluster through torchrun (``torch.distributed.run --standalone``).

``--standalone`` gives the job its own c10d rendezvous on a free loopback port chosen at run
time, so two demos on one machine never merge into one world. The parent process does not
import torch: it runs torchrun as a child in its own process group, writes the workers'
output to a log file, polls a callback while they run (the live display) and kills the
whole group if the hard timeout passes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import cannikin
from cannikin.runtime.quota import ENV_VAR as QUOTA_ENV
from cannikin.runtime.quota import GROUPS_ENV_VAR as QUOTA_GROUPS_ENV

POLL_S = 0.2
"""How often the parent wakes to update its display while the workers run."""
SLOWDOWN_ENV = "CANNIKIN_SLOWDOWN"
"""Read by the workers' HeteroDataParallel (runtime/emulate.py, which imports torch)."""
KILL_GRACE_S = 5.0
"""Time between SIGTERM and SIGKILL when a job is stopped."""


class LaunchError(RuntimeError):
    """The workers failed or ran past the timeout; the message says which and where to look."""


def torchrun_command(nproc: int, module: str, args: Sequence[str]) -> list[str]:
    """The torchrun command line for ``nproc`` workers running ``python -m module args``."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
        "--monitor-interval=0.5",
        "-m", module, *args,
    ]


def worker_env(slowdowns: Sequence[float] | None,
               quota: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for the workers: this checkout's cannikin, one thread, per-rank slowdown
    (None: no emulation) and CPU-quota groups (``QuotaGroups.env()``), no GPU (several
    workers cannot share one GPU under NCCL; they run on gloo)."""
    src = str(Path(cannikin.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    env = {
        **os.environ,
        "PYTHONPATH": src if not path else f"{src}{os.pathsep}{path}",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": "",  # the workers share this machine's CPU
    }
    for name in (SLOWDOWN_ENV, QUOTA_ENV, QUOTA_GROUPS_ENV):  # the run's own, never inherited
        env.pop(name, None)
    env.update(quota or {})
    if slowdowns is not None:
        env[SLOWDOWN_ENV] = ",".join(f"{s:g}" for s in slowdowns)
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop torchrun and every worker it started (they share its process group)."""
    for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def failure_excerpt(log_path: Path, lines: int = 15) -> str:
    """What to show when the workers failed: the first worker traceback in the log (the
    root cause; torchrun's summary follows it), else the log's last lines."""
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    start = next((i for i, line in enumerate(text) if line.startswith("Traceback")), None)
    if start is None:
        return "\n".join(text[-lines:])
    end = next((i for i in range(start + 1, len(text)) if text[i] and not text[i][0].isspace()),
               len(text) - 1)
    return "\n".join(text[max(start, end + 1 - lines):end + 1])


def run_local(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: Path,
    timeout_s: float,
    on_poll: Callable[[], None] = lambda: None,
) -> float:
    """Run ``command`` (a torchrun line) to completion; return its wall time in seconds.

    Raises :class:`LaunchError` when it exits non-zero or runs longer than ``timeout_s``
    (then every process it started is killed). ``on_poll`` runs every ``POLL_S`` seconds and
    once more after the job ends, so a display sees the final records.
    """
    start = time.monotonic()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(command), env=dict(env), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        try:
            while proc.poll() is None:
                if time.monotonic() - start > timeout_s:
                    _stop(proc)
                    raise LaunchError(
                        f"the workers ran past the {timeout_s:g} s timeout and were stopped; "
                        f"see {log_path}"
                    )
                on_poll()
                time.sleep(POLL_S)
        except BaseException:
            _stop(proc)
            raise
    on_poll()
    if proc.returncode != 0:
        raise LaunchError(
            f"the workers failed (torchrun exit code {proc.returncode}); see {log_path}"
        )
    return time.monotonic() - start
