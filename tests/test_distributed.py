"""init_distributed: single process in-process, and real gloo jobs under torchrun."""

import socket
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from cannikin.runtime.distributed import (
    DistContext,
    _agree_on_generation,
    _choose_backend,
    destroy_distributed,
    free_port,
    init_distributed,
)
from dist_utils import WORKERS, run_torchrun

WORKER = WORKERS / "allreduce_worker.py"


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def agree(store: dist.Store, world_size: int, ranks: list[int],
          timeout_s: float = 10.0) -> dict[int, int | BaseException]:
    """Run _agree_on_generation for ``ranks`` in threads, followers first."""
    results: dict[int, int | BaseException] = {}

    def run(rank: int) -> None:
        try:
            results[rank] = _agree_on_generation(store, rank, world_size,
                                                 timedelta(seconds=timeout_s))
        except Exception as error:  # noqa: BLE001 - reported to the test
            results[rank] = error

    threads = [threading.Thread(target=run, args=(r,)) for r in sorted(ranks, reverse=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_generations_agree_despite_stale_keys_of_earlier_ones() -> None:
    store = dist.HashStore()
    first = agree(store, 3, [0, 1, 2])
    assert set(first.values()) == {1}
    # a restarted, smaller group on the same store: rank 1's old join token is still there
    second = agree(store, 2, [0, 1])
    assert set(second.values()) == {2}


def test_generation_leader_names_missing_ranks() -> None:
    store = dist.HashStore()
    result = agree(store, 3, [0, 2], timeout_s=0.5)
    assert isinstance(result[0], RuntimeError)
    assert "ranks [1] did not join process-group generation 1 within 0.5 s" in str(result[0])


def test_single_process_without_launcher() -> None:
    ctx = init_distributed(env={})
    try:
        assert (ctx.rank, ctx.world_size, ctx.local_rank) == (0, 1, 0)
        assert ctx.backend == "gloo" and ctx.device == torch.device("cpu")
        value = torch.tensor([2.0])
        dist.all_reduce(value)
        assert value.item() == 2.0
        assert init_distributed(env={}) == ctx  # an existing group is reused
    finally:
        destroy_distributed()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an integer, got 'x'"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
         r"rank must be in \[0, 2\), got 2"),
    ],
)
def test_bad_environment_is_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        init_distributed(env=env)
    assert not dist.is_initialized()


@pytest.mark.parametrize(("gpus", "local_world_size", "backend"),
                         [(0, 1, "gloo"), (1, 1, "nccl"), (1, 3, "gloo"), (4, 3, "nccl")])
def test_default_backend_is_nccl_only_with_a_gpu_per_process(
        monkeypatch: pytest.MonkeyPatch, gpus: int, local_world_size: int, backend: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert _choose_backend(None, local_world_size) == backend


def test_more_processes_than_gpus_default_to_gloo_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # e.g. the README's 3-worker example on a one-GPU laptop
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ctx = init_distributed(env={"LOCAL_WORLD_SIZE": "3"})
    try:
        assert ctx.backend == "gloo" and ctx.device == torch.device("cpu")
    finally:
        destroy_distributed()


def test_nccl_local_rank_without_a_gpu_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # one GPU and three processes: nccl cannot give local rank 2 a device of its own
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    env = {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}
    with pytest.raises(ValueError, match=r"local rank 2 has none: this machine has 1 CUDA "
                                         r"device\(s\), so run at most 1 process\(es\)"):
        init_distributed(env=env)
    assert not dist.is_initialized()


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        init_distributed(env={}, timeout_s=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        init_distributed("mpi", env={})
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        DistContext(rank=0, world_size=0, local_rank=0, device=torch.device("cpu"),
                    backend="gloo")


def test_hung_worker_fails_peers_with_timeout_naming_rank() -> None:
    result = run_torchrun(WORKER, nproc=2, script_args=["--mode", "hang", "--timeout", "3"],
                          timeout_s=90)
    assert not result.timed_out, "the job hung instead of failing at the collective timeout"
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "rank 0 of 2: all-reduce failed (collective timeout 3 s" in output


def test_elastic_restart_reforms_group_on_shared_store() -> None:
    # Two gloo workers all-reduce through init_distributed, rank 1 dies, torchrun restarts both
    # on its shared store: without the generation prefix they fail with connectFullMesh errors.
    result = run_torchrun(WORKER, nproc=2, max_restarts=1, timeout_s=90,
                          script_args=["--mode", "crash-once", "--timeout", "20"]).check()
    for rank in (0, 1):
        assert f"rank {rank} world 2 restart 1 sum 3" in result.stdout
