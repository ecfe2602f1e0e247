"""Launch torchrun jobs from tests: hard timeouts, the checkout's ``src``, unique endpoints.

Usage from a test::

    from dist_utils import run_torchrun
    result = run_torchrun(WORKERS / "my_worker.py", nproc=3, script_args=["--steps", "5"])
    result.check()                     # AssertionError with the job's output if rc != 0
    assert "ok" in result.stdout

* Workers get ``PYTHONPATH=<checkout>/src:<checkout>/tests`` (so they import this checkout's
  ``cannikin``, not another copy), ``OMP_NUM_THREADS=1`` and unbuffered output. Call
  ``torch.set_num_threads(1)`` in the worker too.
* ``run_torchrun`` runs one ``--standalone`` agent (``max_restarts`` > 0 lets it restart
  failed workers); ``start_torchrun`` starts one without waiting, so several jobs can share
  their start-up time (``job.wait(timeout_s)`` collects them).
* ``start_agents`` runs several agents (plain torchrun, or ``launcher=CANNIKIN_LAUNCH``) on one
  c10d rendezvous (``--nnodes=MIN:MAX``,
  ``last_call_timeout=1`` so start-up is not 30 s, 1 s heartbeats so a lost agent is dropped
  from the next round within ~5 s), on a fresh port and rendezvous id, so concurrent tests
  never merge into one world; the first agent hosts the rendezvous store, so kill another one
  to emulate a lost node (``ElasticJob.kill_agent``). ``start_commands`` starts agents from
  command lines built by the caller (e.g. one per network namespace, tests/netns.py).
* Every agent is killed with all its workers (SIGKILL to the process tree) when ``timeout_s``
  passes: a hung worker fails the test (``timed_out`` is True,
  ``returncode`` is -9), it never hangs the suite.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from cannikin.runtime.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
TESTS = ROOT / "tests"
WORKERS = TESTS / "workers"


@dataclass
class JobResult:
    """What one torchrun agent did."""

    returncode: int
    stdout: str
    stderr: str
    elapsed_s: float
    timed_out: bool

    def check(self) -> JobResult:
        """Raise AssertionError carrying the output unless the job exited 0."""
        if self.returncode != 0:
            raise AssertionError(
                f"torchrun exited {self.returncode} after {self.elapsed_s:.1f} s"
                f"{' (killed at timeout)' if self.timed_out else ''}\n"
                f"--- stdout ---\n{self.stdout[-6000:]}\n--- stderr ---\n{self.stderr[-6000:]}"
            )
        return self


def worker_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for an agent and its workers: this checkout first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(TESTS)])
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclass
class _Agent:
    proc: subprocess.Popen[bytes]
    out: IO[bytes]
    err: IO[bytes]
    started: float


@dataclass
class ElasticJob:
    """A set of running torchrun agents; ``wait`` collects them, killing any left at timeout."""

    agents: list[_Agent] = field(default_factory=list)
    killed: set[int] = field(default_factory=set)

    def kill_agent(self, index: int) -> None:
        """SIGKILL agent ``index`` and its workers, as a lost node would vanish."""
        _kill_tree(self.agents[index].proc.pid)
        self.killed.add(index)

    def wait(self, timeout_s: float) -> list[JobResult]:
        """Wait for every agent (``timeout_s`` from now for all together); return their results."""
        deadline = time.monotonic() + timeout_s
        results = []
        for agent in self.agents:
            timed_out = False
            try:
                agent.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_tree(agent.proc.pid)
                agent.proc.wait()
            results.append(JobResult(agent.proc.returncode, _read(agent.out), _read(agent.err),
                                     time.monotonic() - agent.started, timed_out))
        return results


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids of every process visible in /proc."""
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")"
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            tree.setdefault(ppid, []).append(int(stat.parent.name))
    return tree


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants. torchrun starts each worker in a session of
    its own, so killing the agent's process group would leave its workers running."""
    tree, family, todo = _children(), [], [pid]
    while todo:
        current = todo.pop()
        family.append(current)
        todo += tree.get(current, [])
    for member in family:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member, signal.SIGKILL)


def _read(handle: IO[bytes]) -> str:
    handle.seek(0)
    text = handle.read().decode(errors="replace")
    handle.close()
    return text


def _start(cmd: Sequence[str], env: Mapping[str, str]) -> _Agent:
    # The files outlive this function: ElasticJob.wait reads and closes them.
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115
    proc = subprocess.Popen(list(cmd), stdout=out, stderr=err, env=dict(env), cwd=ROOT,
                            start_new_session=True)
    return _Agent(proc, out, err, time.monotonic())


TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
"""Plain torchrun."""
CANNIKIN_LAUNCH = (sys.executable, "-m", "cannikin.launch")
"""``cannikin launch``: torchrun with Cannikin's defaults."""


def torchrun_command(script: str | Path, *, nproc_per_node: int, nnodes: str = "1",
                     max_restarts: int = 0, rdzv_endpoint: str | None = None,
                     rdzv_id: str | None = None, is_host: bool | None = None,
                     last_call_s: float | None = 1.0, script_args: Sequence[str] = (),
                     launcher: Sequence[str] = TORCHRUN) -> list[str]:
    """The ``launcher`` command line; no endpoint means ``--standalone``.

    ``last_call_s``: how long a rendezvous that has its minimum of nodes waits for more; None
    passes no ``--rdzv-conf`` at all (``is_host`` is then not passed either), leaving the
    rendezvous settings to the launcher.
    """
    cmd = [*launcher, f"--nproc-per-node={nproc_per_node}", f"--nnodes={nnodes}",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.1"]
    if rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id or uuid.uuid4().hex}"]
        if last_call_s is not None:
            # last call short instead of 30 s; a dead agent is noticed after 5 s of silent
            # heartbeats
            conf = (f"last_call_timeout={last_call_s:g},keep_alive_interval=1,"
                    "keep_alive_max_attempt=5")
            if is_host is not None:
                conf += f",is_host={int(is_host)}"
            cmd.append(f"--rdzv-conf={conf}")
    return [*cmd, str(script), *script_args]


def start_torchrun(script: str | Path, *, nproc: int = 2, script_args: Sequence[str] = (),
                   max_restarts: int = 0, env: Mapping[str, str] | None = None,
                   launcher: Sequence[str] = TORCHRUN) -> ElasticJob:
    """Start ``script`` on ``nproc`` local workers under one standalone agent; not waiting."""
    cmd = torchrun_command(script, nproc_per_node=nproc, max_restarts=max_restarts,
                           script_args=script_args, launcher=launcher)
    return ElasticJob([_start(cmd, worker_env(env))])


def run_torchrun(script: str | Path, *, nproc: int = 2, script_args: Sequence[str] = (),
                 timeout_s: float = 120.0, max_restarts: int = 0,
                 env: Mapping[str, str] | None = None,
                 launcher: Sequence[str] = TORCHRUN) -> JobResult:
    """Run ``script`` on ``nproc`` local workers under one standalone agent, hard timeout."""
    job = start_torchrun(script, nproc=nproc, script_args=script_args,
                         max_restarts=max_restarts, env=env, launcher=launcher)
    return job.wait(timeout_s)[0]


def start_commands(commands: Sequence[tuple[Sequence[str], Mapping[str, str]]]) -> ElasticJob:
    """Start each ``(command line, environment)`` as one agent of one job, as given (e.g.
    behind ``ip netns exec``, with ``torchrun_command``'s lines and ``worker_env``'s env)."""
    return ElasticJob([_start(cmd, env) for cmd, env in commands])


def start_agents(script: str | Path, *, nnodes: int, min_nodes: int | None = None,
                 nproc_per_node: int = 1, max_restarts: int = 0,
                 script_args: Sequence[str] = (), last_call_s: float | None = 1.0,
                 env: Mapping[str, str] | None = None,
                 launcher: Sequence[str] = TORCHRUN, agents: int | None = None) -> ElasticJob:
    """Start ``nnodes`` agents on one fresh c10d rendezvous (``--nnodes=min_nodes:nnodes``).

    Agent 0 hosts the rendezvous store; the others are clients of it. With ``min_nodes`` below
    ``nnodes`` the first round completes ``last_call_s`` after the minimum has joined, so a test
    that needs every agent in the first world must allow for the slowest agent's start-up.
    ``agents``: how many to start (default ``nnodes``; fewer leaves the rendezvous short of its
    maximum, as when nodes are missing). ``launcher`` is the command each agent runs (e.g.
    ``CANNIKIN_LAUNCH``); with ``last_call_s=None`` it gets no ``--rdzv-conf``.
    """
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv_id = uuid.uuid4().hex
    span = f"{min_nodes if min_nodes is not None else nnodes}:{nnodes}"
    job = ElasticJob()
    for index in range(nnodes if agents is None else agents):
        cmd = torchrun_command(script, nproc_per_node=nproc_per_node, nnodes=span,
                               max_restarts=max_restarts, rdzv_endpoint=endpoint,
                               rdzv_id=rdzv_id, is_host=(index == 0),
                               last_call_s=last_call_s, script_args=script_args,
                               launcher=launcher)
        job.agents.append(_start(cmd, worker_env(env)))
        if index == 0:
            time.sleep(0.5)  # let the host agent bind the rendezvous store first
    return job
