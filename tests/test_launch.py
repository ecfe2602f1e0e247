"""``cannikin launch`` end to end: an elastic job started without any --rdzv-conf.

``--nnodes=2:3`` with two agents: the round has its minimum but not its maximum, so c10d
closes it only after ``last_call_timeout``. With plain torchrun that is 30 s; through the
launcher's default it is 1 s. (With ``--nnodes=1:2`` and two agents the round closes as soon
as the second joins, so the default would not be exercised, and a second agent starting more
than 1 s after the first would make a world of one.) The measured start-up is printed, not
asserted; benchmarks/bench_launch.py compares it side by side with plain torchrun.

A restart through the launcher runs on a fresh rendezvous store per worker generation
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): rank 0's worker then hosts the store that
``init_distributed`` builds the group on, a path plain torchrun never takes.
"""

from __future__ import annotations

from dist_utils import CANNIKIN_LAUNCH, WORKERS, run_torchrun, start_agents

TIMEOUT_S = 28.0  # plain torchrun's 30 s last call alone would not fit


def test_elastic_job_through_cannikin_launch_starts_without_rdzv_conf() -> None:
    job = start_agents(WORKERS / "allreduce_worker.py", nnodes=3, min_nodes=2,
                       launcher=CANNIKIN_LAUNCH, last_call_s=None, agents=2)
    results = job.wait(TIMEOUT_S)
    for result in results:
        result.check()
    lines = sorted(line for r in results for line in r.stdout.splitlines()
                   if line.startswith("rank "))
    assert lines == [f"rank {r} world 2 restart 0 sum 3 backend gloo store own"
                     for r in range(2)], lines
    print(f"\ncannikin launch, --nnodes=2:3, 2 agents: done in "
          f"{max(r.elapsed_s for r in results):.1f} s")


def test_restart_through_cannikin_launch_reforms_the_group_on_a_fresh_store() -> None:
    result = run_torchrun(WORKERS / "allreduce_worker.py", nproc=2, max_restarts=1,
                          timeout_s=90, launcher=CANNIKIN_LAUNCH,
                          script_args=["--mode", "crash-once", "--timeout", "20"]).check()
    for rank in (0, 1):
        assert f"rank {rank} world 2 restart 1 sum 3 backend gloo store own" in result.stdout
