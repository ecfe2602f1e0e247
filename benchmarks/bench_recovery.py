"""Recovery times of a 2-host job through ``cannikin launch``, at its defaults.

Three faults (tests/recovery.py has the details), each on a fresh job of two agents with one
gloo worker each, ``--nnodes=1:2``, training a small MLP with HeteroDataParallel:

* a lost node: SIGKILL of host b's agent and worker; figures: the survivor's collective error,
  the restarted worker's start and its first step in the world of 1, in seconds from the kill;
* a cut link: host b's veth taken down; the same figures from the cut (the survivor's error
  comes at the collective timeout, 30 s by default once steps are measured);
* an agent lost at the end: host b's agent dies as the workers finish; how long host a's
  agent then waits at torchrun's exit barrier (30 s through the launcher; torchrun: 300 s).

Hosts are network namespaces joined by a veth (tests/netns.py; needs root, ``ip`` and
``tc``). Without them the lost node and the exit run on loopback and the cut link is skipped,
with the reason. Set ``CANNIKIN_TIMEOUT_FLOOR_S`` or ``CANNIKIN_EXIT_BARRIER_TIMEOUT_S`` to
see other settings. Run: ``python benchmarks/bench_recovery.py [--repeat N]`` (~2 min a
round); the load average is printed with the figures, since 2 busy cores slow every phase.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from netns import HostPair, NetnsUnavailable, host_pair  # noqa: E402
from recovery import Recovery, cut_link, lose_agent_at_exit, lose_node  # noqa: E402


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _line(name: str, r: Recovery) -> str:
    error = "-" if r.error_s is None else f"{r.error_s:.1f}"
    return (f"{name:<10} timeout {r.timeout_s:>5.1f} s: error {error:>5} s, restart "
            f"{r.restart_s:>5.1f} s, resumed {r.resumed_s:>5.1f} s (load {_load()})")


def one_round(hosts: HostPair | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "lost").mkdir()
        print(_line("lost node", lose_node(out / "lost", hosts)), flush=True)
        if hosts is not None:
            (out / "cut").mkdir()
            print(_line("cut link", cut_link(out / "cut", hosts)), flush=True)
        (out / "exit").mkdir()
        waited = lose_agent_at_exit(out / "exit", hosts)
        print(f"{'exit':<10} survivor waited {waited.waited_s:.1f} s at the exit barrier, "
              f"exit status {waited.survivor.returncode} (load {_load()})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="rounds of the three faults")
    args = parser.parse_args()
    settings = {name: os.environ[name] for name in
                ("CANNIKIN_TIMEOUT_FLOOR_S", "CANNIKIN_TIMEOUT_STEPS",
                 "CANNIKIN_EXIT_BARRIER_TIMEOUT_S") if name in os.environ}
    print(f"settings: {settings or 'the defaults'}")
    with contextlib.ExitStack() as stack:
        try:
            hosts: HostPair | None = stack.enter_context(host_pair())
            print("hosts: two network namespaces joined by a veth")
        except NetnsUnavailable as error:
            hosts = None
            print(f"hosts: loopback; the cut link is skipped: {error}")
        for _ in range(args.repeat):
            one_round(hosts)


if __name__ == "__main__":
    main()
