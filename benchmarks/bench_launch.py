"""Start-up of an elastic job: plain torchrun vs ``cannikin launch``, neither given --rdzv-conf.

Each case starts 2 agents (one gloo worker each) on a fresh c10d rendezvous on 127.0.0.1; the
workers form a group through ``init_distributed``, all-reduce once and exit. The figure is the
wall time from the first agent's start until both have exited.

* ``--nnodes=1:2``: the round closes as soon as the second agent joins (its maximum), so
  c10d's last call does not matter.
* ``--nnodes=2:3``: the round has its minimum but never its maximum, so it closes only after
  ``last_call_timeout``: c10d's 30 s default with plain torchrun, 1 s through the launcher.
  This is the case of an elastic job started with fewer nodes than it could use, and of
  every membership change.

Run: ``python benchmarks/bench_launch.py`` (~1 min; cases run one after another).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from dist_utils import CANNIKIN_LAUNCH, TORCHRUN, WORKERS, start_agents  # noqa: E402

CASES = (("1:2", 1, 2), ("2:3", 2, 3))
TIMEOUT_S = 120.0


def startup(launcher: tuple[str, ...], min_nodes: int, max_nodes: int) -> tuple[float, str]:
    """Seconds until both agents exited, and the world sizes the workers reported."""
    job = start_agents(WORKERS / "allreduce_worker.py", nnodes=max_nodes, min_nodes=min_nodes,
                       agents=2, launcher=launcher, last_call_s=None)
    results = job.wait(TIMEOUT_S)
    for result in results:
        result.check()
    worlds = sorted(line.split()[3] for r in results for line in r.stdout.splitlines()
                    if line.startswith("rank "))
    return max(r.elapsed_s for r in results), ",".join(worlds)


def main() -> None:
    print("start-up with 2 agents (worker world sizes in brackets)")
    print(f"{'--nnodes':>8}  {'torchrun (s)':>16}  {'cannikin launch (s)':>19}")
    for span, lo, hi in CASES:
        plain, plain_worlds = startup(TORCHRUN, lo, hi)
        ours, our_worlds = startup(CANNIKIN_LAUNCH, lo, hi)
        print(f"{span:>8}  {plain:>7.1f} [{plain_worlds:>5}]  {ours:>10.1f} [{our_worlds:>5}]",
              flush=True)


if __name__ == "__main__":
    main()
