"""Recovery from faults through ``cannikin launch`` (tests/recovery.py runs them).

Two agents, one per network namespace where this machine allows (tests/netns.py), else on
loopback (then the cut link is skipped, with the reason). The bounds are loose, so that 2 busy
cores never flake them; benchmarks/bench_recovery.py prints the figures at the defaults
(docs/reliability.md has them).

* A lost node: the survivor trains again in a world of 1 well within 30 s (16-31 s before the
  launcher's 1 s heartbeats; measured here ~10 s at a load of 4.5).
* A cut link, with ``CANNIKIN_TIMEOUT_FLOOR_S=5`` to keep the suite short: the timeout in
  force at the cut is the 5 s floor (lowered from the 300 s start-up bound), the survivor's
  collective fails after it, not before, and it trains again well within 60 s (the start-up
  bound alone would have stalled it 300 s).
* An agent lost as the workers finish (on loopback, at the same time as the lost node), with
  ``CANNIKIN_EXIT_BARRIER_TIMEOUT_S=1``: the survivor exits 0 within 30 s of its worker's
  end (torchrun alone: 300 s).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from netns import HostPair, NetnsUnavailable, host_pair
from recovery import ExitWait, Recovery, cut_link, lose_agent_at_exit, lose_node

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def hosts() -> Iterator[HostPair | None]:
    """Two namespaces, or None (loopback) where they cannot be built."""
    try:
        with host_pair() as pair:
            yield pair
    except NetnsUnavailable:
        yield None


@pytest.fixture(scope="module")
def lost(tmp_path_factory: pytest.TempPathFactory,
         hosts: HostPair | None) -> tuple[Recovery, ExitWait]:
    """The lost node and the agent lost at exit, run at the same time (two jobs, their
    start-ups overlapping: ~15 s less suite time, and a busier machine for both)."""
    with ThreadPoolExecutor(2) as pool:
        node = pool.submit(lose_node, tmp_path_factory.mktemp("node"), hosts, timeout_s=90)
        # on loopback: the namespaces' addresses and ports are the other job's
        at_exit = pool.submit(lose_agent_at_exit, tmp_path_factory.mktemp("exit"), None,
                              env={"CANNIKIN_EXIT_BARRIER_TIMEOUT_S": "1"}, timeout_s=90)
        return node.result(), at_exit.result()


def test_a_lost_node_is_replaced_by_a_smaller_world_within_seconds(
        lost: tuple[Recovery, ExitWait]) -> None:
    recovery = lost[0]
    print(f"\nlost node: error {recovery.error_s} s, restart {recovery.restart_s:.1f} s, "
          f"resumed {recovery.resumed_s:.1f} s")
    recovery.survivor.check()
    assert recovery.error_s is not None and recovery.error_s < 10, recovery
    assert recovery.resumed_s < 30, recovery


def test_a_lost_agent_keeps_the_survivor_at_the_exit_barrier_only_briefly(
        lost: tuple[Recovery, ExitWait]) -> None:
    waited = lost[1]
    print(f"\nexit barrier: the survivor waited {waited.waited_s:.1f} s")
    waited.survivor.check()
    assert "Error waiting on exit barrier. Elapsed: 1.0" in waited.survivor.stderr
    assert waited.waited_s < 30, waited.waited_s


def test_a_cut_link_fails_over_at_the_lowered_timeout(tmp_path: Path,
                                                      hosts: HostPair | None) -> None:
    if hosts is None:
        with pytest.raises(NetnsUnavailable) as why, host_pair():
            pass
        pytest.skip(f"a cut link needs two network namespaces: {why.value}")
    recovery = cut_link(tmp_path, hosts, env={"CANNIKIN_TIMEOUT_FLOOR_S": "5"}, timeout_s=90)
    print(f"\ncut link: timeout {recovery.timeout_s} s, error {recovery.error_s} s, "
          f"restart {recovery.restart_s:.1f} s, resumed {recovery.resumed_s:.1f} s")
    recovery.survivor.check()
    assert recovery.timeout_s == 5.0, recovery
    assert recovery.error_s is not None and 4.5 < recovery.error_s < 30, recovery
    assert recovery.resumed_s < 60, recovery
