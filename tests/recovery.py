"""Faults of a running 2-agent job, timed: a lost node, a cut link, an agent lost at the end.

Shared by benchmarks/bench_recovery.py (which prints the figures at the defaults) and
tests/test_recovery.py (which asserts loose bounds, with shorter timeouts so the suite stays
short). Each job is two ``cannikin launch`` agents (``--nnodes=1:2``, one worker each,
``tests/workers/recovery_worker.py``, which logs the wall-clock time of its events), either on
loopback or one per network namespace of a :class:`netns.HostPair` (gloo over the veth).
Agent 0 (host a) hosts the rendezvous store, so agent 1 (host b) is the one that fails.

* :func:`lose_node`: SIGKILL agent 1 with its worker, as a host that vanishes. The survivor's
  next collective fails at once (the kernel resets the connections); its agent waits until
  c10d drops the dead node (its heartbeats stop) and restarts the worker in a world of 1.
* :func:`cut_link`: ``ip link set <b's veth> down`` in b's namespace. Nothing tells host a:
  its worker waits in its collective until the collective timeout, then fails and is
  restarted alone (b's heartbeats stopped at the cut, so c10d dropped it long before).
* :func:`lose_agent_at_exit`: both workers finish; agent 1 is SIGKILLed as its worker writes
  ``done``; agent 0 then waits at torchrun's exit barrier for the agent that never comes.

Every figure is seconds from the fault (wall clock, one machine) to an event of a run.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dist_utils import (
    CANNIKIN_LAUNCH,
    WORKERS,
    ElasticJob,
    JobResult,
    free_port,
    start_commands,
    torchrun_command,
    worker_env,
)
from netns import HostPair

WORKER = WORKERS / "recovery_worker.py"
AGENT_ENV = "RECOVERY_AGENT"
"""Which agent (0 or 1) a worker runs under; it logs it with each event."""
STEADY_STEPS = 12
"""Steps each rank trains in the world of 2 before the fault (the timeout is lowered by then:
steps 1-4 are measured, and a held plan every 4th step)."""
_ports = itertools.count(29471)  # in fresh namespaces nothing else listens


@dataclass
class Recovery:
    """Seconds from the fault to what the surviving host's runs did."""

    error_s: float | None
    """Its worker's collective failed (None: it never logged one)."""
    restart_s: float
    """The restarted worker started (after the rendezvous of the smaller world)."""
    resumed_s: float
    """The restarted worker finished its first step in the world of 1."""
    timeout_s: float
    """The collective timeout in force when the fault came."""
    survivor: JobResult
    """Agent 0 (it exited 0: it finished the steps after the fault)."""


def read_events(out: Path) -> list[dict[str, Any]]:
    """Every run's events so far, by time; a line still being written is left for later."""
    events = [json.loads(line) for path in sorted(out.glob("events-*.jsonl"))
              for line in path.read_text().split("\n")[:-1]]
    return sorted(events, key=lambda e: e["t"])


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str,
             job: ElasticJob) -> None:
    """Poll ``condition``; on timeout kill the job and fail with the agents' output."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            results = job.wait(0)
            tails = "\n".join(f"--- agent {i} (rc {r.returncode}) ---\n{r.stderr[-3000:]}"
                              for i, r in enumerate(results))
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}\n{tails}")
        time.sleep(0.05)


def _kill_all(job: ElasticJob) -> None:
    """Leave no agent or worker behind, whatever failed (agents already reaped are skipped:
    their pids may belong to someone else by now)."""
    for index, agent in enumerate(job.agents):
        if agent.proc.poll() is None:
            job.kill_agent(index)


def start_job(out: Path, hosts: HostPair | None, *, env: Mapping[str, str] | None = None,
              script_args: Sequence[str] = ()) -> ElasticJob:
    """Two ``cannikin launch`` agents on one c10d rendezvous, agent 0 its host; the launcher
    is given none of the ``--rdzv-conf`` keys it sets, so its own defaults are measured."""
    args = [str(out), *script_args]
    rdzv_id = uuid.uuid4().hex
    if hosts is None:
        places = [([], {}), ([], {})]
        endpoint = f"127.0.0.1:{free_port()}"
    else:
        places = [(host.exec_prefix, {"GLOO_SOCKET_IFNAME": host.ifname})
                  for host in (hosts.a, hosts.b)]
        endpoint = f"{hosts.a.address}:{next(_ports)}"
    commands = []
    for index, (prefix, place_env) in enumerate(places):
        place_env = {**place_env, AGENT_ENV: str(index)}
        cmd = torchrun_command(WORKER, nproc_per_node=1, nnodes="1:2", max_restarts=3,
                               rdzv_endpoint=endpoint, rdzv_id=rdzv_id, last_call_s=None,
                               script_args=args, launcher=[*prefix, *CANNIKIN_LAUNCH])
        if hosts is None:
            # on loopback both agents own the endpoint, and under load the second one can bind
            # the store first; the launcher still adds its defaults to this --rdzv-conf
            cmd.insert(cmd.index(str(WORKER)), f"--rdzv-conf=is_host={int(index == 0)}")
        commands.append((cmd, worker_env({**place_env, **(env or {})})))
    return start_commands(commands)  # is_host=1 for agent 0 only: both can start at once


def _steady(out: Path, job: ElasticJob, timeout_s: float) -> None:
    """Wait until both ranks trained STEADY_STEPS steps together in a world of 2."""
    def ready() -> bool:
        steps = [e for e in read_events(out) if e["event"] == "step" and e["world"] == 2]
        return {r for r in (0, 1) if sum(e["rank"] == r for e in steps) >= STEADY_STEPS} \
            == {0, 1}
    wait_for(ready, timeout_s, f"both ranks to train {STEADY_STEPS} steps in a world of 2", job)


def _survivor_figures(out: Path, fault_t: float, job: ElasticJob, timeout_s: float) -> Recovery:
    """Wait for the restarted world of 1 to train a step, time it, and collect agent 0."""
    def resumed() -> bool:
        return any(e["event"] == "step" and e["after_fault"] and e["world"] == 1
                   for e in read_events(out))
    wait_for(resumed, timeout_s, "a restarted world of 1 to train a step", job)
    events = read_events(out)
    before = [e for e in events if e["event"] == "step" and e["t"] <= fault_t]
    errors = [e["t"] for e in events if e["event"] == "error" and not e["after_fault"]]
    start = next(e for e in events if e["event"] == "start" and e["after_fault"])
    step = next(e for e in events if e["event"] == "step" and e["after_fault"])
    job.kill_agent(1)  # after a cut link it is still waiting; after a kill, gone already
    survivor = job.wait(timeout_s)[0]
    return Recovery(error_s=min(errors) - fault_t if errors else None,
                    restart_s=start["t"] - fault_t, resumed_s=step["t"] - fault_t,
                    timeout_s=before[-1]["timeout_s"], survivor=survivor)


def lose_node(out: Path, hosts: HostPair | None, *, env: Mapping[str, str] | None = None,
              timeout_s: float = 120.0) -> Recovery:
    """SIGKILL agent 1 and its worker mid-training; time the survivor's recovery."""
    job = start_job(out, hosts, env=env)
    try:
        _steady(out, job, timeout_s)
        (out / "fault").touch()
        fault_t = time.time()
        job.kill_agent(1)
        return _survivor_figures(out, fault_t, job, timeout_s)
    finally:
        _kill_all(job)


def cut_link(out: Path, hosts: HostPair, *, env: Mapping[str, str] | None = None,
             timeout_s: float = 180.0) -> Recovery:
    """Take b's end of the veth down mid-training; time host a's recovery; link up again."""
    job = start_job(out, hosts, env=env)
    try:
        _steady(out, job, timeout_s)
        (out / "fault").touch()
        fault_t = time.time()
        hosts.set_link(hosts.b, up=False)
        return _survivor_figures(out, fault_t, job, timeout_s)
    finally:
        hosts.set_link(hosts.b, up=True)
        _kill_all(job)


@dataclass
class ExitWait:
    """How long agent 0 stayed after its worker finished, its lost peer never arriving."""

    waited_s: float
    survivor: JobResult


def lose_agent_at_exit(out: Path, hosts: HostPair | None, *,
                       env: Mapping[str, str] | None = None,
                       timeout_s: float = 120.0) -> ExitWait:
    """Both workers train STEADY_STEPS steps; agent 1 is SIGKILLed at the first ``done``."""
    job = start_job(out, hosts, env=env, script_args=["--max-steps", str(STEADY_STEPS)])
    try:
        def done(agent: int) -> list[dict[str, Any]]:
            return [e for e in read_events(out) if e["event"] == "done" and e["agent"] == agent]
        wait_for(lambda: bool(done(0) or done(1)), timeout_s, "a worker to finish", job)
        job.kill_agent(1)
        wait_for(lambda: bool(done(0)), timeout_s, "agent 0's worker to finish", job)
        survivor = job.wait(timeout_s)[0]
        return ExitWait(waited_s=time.time() - done(0)[0]["t"], survivor=survivor)
    finally:
        _kill_all(job)
