"""Process-group set-up for Cannikin workers: the one place that reads the launch environment.

``init_distributed`` turns what torchrun (or a plain ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``
environment, or nothing at all) provides into an explicit :class:`DistContext` that the rest of
the runtime is given. It also carries two fixes that every user script would otherwise need:

* **Collective timeout.** The process group gets a finite timeout (gloo enforces it on every
  collective), so a worker that hangs makes its peers fail with an error instead of blocking
  forever; :func:`collective_timeout_error` re-raises such failures naming the rank. It is
  the start-up bound: once steps are measured, ``HeteroDataParallel`` lowers it to a multiple
  of the step time (:mod:`cannikin.runtime.step_timeout`).
* **Elastic restarts on a shared store.** torchrun (torch >= 2.4) lets every restarted worker
  group reuse the agent's TCPStore. ``init_process_group(init_method="env://")`` then reads the
  *previous* group's gloo addresses and fails with "Gloo connectFullMesh failed ... Connection
  refused". Each worker generation must use keys of its own. Keying them by
  ``TORCHELASTIC_RESTART_COUNT`` (the obvious fix) is not enough: that count is per agent, and
  when one agent restarts after its worker failed while another restarts a still-healthy worker
  for the membership change, the counts differ and the group never forms (a connectFullMesh
  timeout after a restart in one of ~5 runs of the lost-node test with that prefix).
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each generation a fresh store, but it must
  be set in the *agent's* environment, which a library inside the worker cannot do. So the
  workers agree on a generation number through the store itself
  (:func:`_agree_on_generation`): rank 0 draws a new number with an atomic ``add`` and hands it
  to each worker under a key named by that worker's random token, which no earlier generation
  can have written; the process group is then built on a ``PrefixStore`` of that generation.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import (  # type: ignore[attr-defined]  # re-exported from torch._C
    HashStore,
    PrefixStore,
    Store,
    TCPStore,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
"""Collective timeout at start-up: generous for loading and the first steps, far below torch's
30 min default (training lowers it: :mod:`cannikin.runtime.step_timeout`)."""

_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True, kw_only=True)
class DistContext:
    """Who this process is in the job; passed explicitly to every runtime component."""

    rank: int
    """Global rank, 0 <= rank < world_size."""
    world_size: int
    """Number of workers in the current (possibly restarted) group."""
    local_rank: int
    """Rank on this machine; selects the GPU."""
    device: torch.device
    """Where this worker computes: ``cuda:<local_rank>`` with nccl, else cpu."""
    backend: str
    """The process-group backend, "gloo" or "nccl"."""
    restart_count: int = 0
    """How many times torchrun has restarted this worker group (0 on the first run)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Collective timeout the process group was made with (the start-up bound), seconds."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {self.local_rank}")
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {self.backend!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (the OS picks it; another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"environment variable {name} must be set (torchrun sets it)")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _choose_backend(backend: str | None, local_world_size: int) -> str:
    """nccl where every process on this machine can have a GPU of its own, else gloo."""
    if backend is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return "nccl" if 0 < local_world_size <= gpus else "gloo"
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS} or None, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, which is not available; use 'gloo'")
    return backend


def _device_for(backend: str, local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` with nccl (which refuses two ranks on one GPU), else cpu."""
    if backend != "nccl":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(
            f"backend 'nccl' gives each process its own GPU, but local rank {local_rank} has "
            f"none: this machine has {count} CUDA device(s), so run at most {count} "
            f"process(es) per node, or use backend 'gloo'")
    return torch.device("cuda", local_rank)


_POLL_S = 0.01


def _agree_on_generation(store: Store, rank: int, world_size: int,
                         timeout: timedelta) -> int:
    """A number that every worker of this group gets and that no earlier group used.

    Keys left by earlier generations may still be in a shared store, so a worker trusts only
    keys that cannot be stale: one named by its own fresh token (for followers) or by the new
    generation number (for the leader, rank 0).
    """
    if rank != 0:
        token = uuid.uuid4().hex
        store.set(f"cannikin/join/{rank}", token)
        store.wait([f"cannikin/ack/{token}"], timeout)
        generation = int(store.get(f"cannikin/ack/{token}"))
        store.set(f"cannikin/ready/{generation}/{rank}", "1")
        return generation
    generation = int(store.add("cannikin/generation", 1))
    ready = {r: f"cannikin/ready/{generation}/{r}" for r in range(1, world_size)}
    acked: set[str] = set()
    deadline = time.monotonic() + timeout.total_seconds()
    while ready:
        for r in list(ready):
            if store.check([ready[r]]):
                del ready[r]
            elif store.check([f"cannikin/join/{r}"]):
                token = store.get(f"cannikin/join/{r}").decode()
                if token not in acked:  # a stale token is acked too; nobody waits for it
                    store.set(f"cannikin/ack/{token}", str(generation))
                    acked.add(token)
        if ready:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank 0: ranks {sorted(ready)} did not join process-group generation "
                    f"{generation} within {timeout.total_seconds():g} s")
            time.sleep(_POLL_S)
    return generation


def _make_store(env: Mapping[str, str], rank: int, world_size: int,
                timeout: timedelta) -> Store:
    """The store the group rendezvous on, with a key prefix per worker generation."""
    if world_size == 1 and "MASTER_ADDR" not in env:
        return HashStore()
    host = env.get("MASTER_ADDR", "")
    if not host:
        raise ValueError("environment variable MASTER_ADDR must be set when WORLD_SIZE > 1")
    port = _env_int(env, "MASTER_PORT")
    # Under torchrun's shared store the agent hosts the server; otherwise rank 0 does.
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = TCPStore(host, port, world_size, is_master=(rank == 0 and not agent_store),
                          timeout=timeout)
    generation = _agree_on_generation(store, rank, world_size, timeout)
    return PrefixStore(f"cannikin/generation_{generation}", store)


def init_distributed(backend: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                     env: Mapping[str, str] | None = None) -> DistContext:
    """Initialise the default process group from the launch environment and describe it.

    ``backend`` None picks nccl when this machine has a GPU for each of its processes
    (``LOCAL_WORLD_SIZE``), else gloo on CPU. Without ``RANK`` in the environment a
    single-process group is made, so scripts also run without torchrun. If a default group
    already exists it is reused (its backend wins) and described.
    """
    env = os.environ if env is None else env
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    rank = _env_int(env, "RANK", 0)
    world_size = _env_int(env, "WORLD_SIZE", 1)
    local_rank = _env_int(env, "LOCAL_RANK", 0)
    restart_count = _env_int(env, "TORCHELASTIC_RESTART_COUNT", 0)
    if dist.is_initialized():
        backend = str(dist.get_backend())
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        backend = _choose_backend(backend, _env_int(env, "LOCAL_WORLD_SIZE", 1))
    device = _device_for(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = DistContext(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                      backend=backend, restart_count=restart_count, timeout_s=timeout_s)
    if dist.is_initialized():
        logger.info("reusing the existing process group: %s", ctx)
        return ctx
    timeout = timedelta(seconds=timeout_s)
    store = _make_store(env, rank, world_size, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    logger.info("process group ready: rank %d of %d, backend %s, device %s, restart %d",
                rank, world_size, backend, device, restart_count)
    return ctx


def collective_timeout_error(ctx: DistContext, what: str, cause: BaseException) -> RuntimeError:
    """An error for a failed collective that names the rank, the operation and the timeout.

    Use as ``except RuntimeError as e: raise collective_timeout_error(ctx, "all-gather", e)
    from e`` around collectives, so a hung or dead peer is reported with this rank's identity.
    """
    return RuntimeError(
        f"rank {ctx.rank} of {ctx.world_size}: {what} failed (collective timeout "
        f"{ctx.timeout_s:g} s; a peer worker may be hung or dead): {cause}"
    )


def destroy_distributed() -> None:
    """Tear the default process group down if there is one (safe to call twice)."""
    if dist.is_initialized():
        dist.destroy_process_group()
