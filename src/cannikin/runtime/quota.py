"""Real heterogeneity on one machine: one CPU-quota group per worker (DESIGN §10).

The sleep-padding emulation (:mod:`cannikin.runtime.emulate`) slows the model's compute only;
a CPU quota slows everything a worker does (forward, backward, optimizer, the runtime's hooks,
gloo), as a slower machine would. A parent process creates one cgroup per rank with
:meth:`QuotaGroups.create` (cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, or v2
``cpu.max``), passes :meth:`QuotaGroups.env` to the workers, and removes the groups when they
have exited. Each worker calls :func:`join_from_env` at its entry point (where
``CANNIKIN_SLOWDOWN`` is read too), after its imports (a 25% worker imports torch 4x slower)
and before it starts the process group; it writes the worker's PID into its rank's
``cgroup.procs``, which moves all its threads, and threads or children started later inherit
the group.

A share is a fraction of one core per period (``quota = share x period``). Measured here with
a 10 ms period, shares 1 : 0.5 : 0.25 ran at speeds 1 : 0.46-0.51 : 0.20-0.22: the smallest
share is slower than its share. Shorter periods
are less bursty. A quota is a limit, not a reservation, so the job's group also gets a high
CPU weight (:data:`WEIGHT_FACTOR`): then a busy machine's other processes slow the workers
little. A burst of work shorter than the quota runs at full speed (a worker that waited on
an all-reduce starts the next period with its quota whole), so a slow worker's speed is
seen over many periods, not in a 2 ms forward pass.
Pure Python (no torch), so a launcher can use it before any worker starts.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

ENV_VAR = "CANNIKIN_CPU_QUOTA"
"""Comma-separated CPU shares, one per rank (``1,0.5,0.25``)."""
GROUPS_ENV_VAR = "CANNIKIN_CPU_QUOTA_GROUPS"
"""Directory holding the ranks' groups ``rank0``, ``rank1``, ... (made by the parent)."""
DEFAULT_PERIOD_US = 10_000
"""CFS period: 10 ms is less bursty than the kernel's 100 ms default (step CV 0.19 at 5 ms,
0.33 at 20 ms for a fixed split, DESIGN §10)."""
MIN_QUOTA_US = 1_000
"""The kernel refuses a quota below 1 ms per period."""
WEIGHT_FACTOR = 10
"""The job's group gets this many times the default CPU weight (v1 ``cpu.shares`` 1024, v2
``cpu.weight`` 100), so that on a busy machine its workers still get their quotas: measured
here at load 3.5, a 100% worker in a default-weight group got 26% of a core, as slow as the
25% one. The quotas cap what the job takes (their sum fits the cores), so other processes
keep the rest."""
JOB_PREFIX = "cannikin-"
FALLBACK = ("fall back to the sleep-padding emulation (CANNIKIN_SLOWDOWN; "
            "cannikin demo --heterogeneity emulate)")


class QuotaUnavailable(RuntimeError):
    """CPU quotas cannot be set on this machine; the message is one line naming the fallback."""


@dataclass(frozen=True)
class Hierarchy:
    """Where quota groups are made: ``path`` is a cgroup directory with the cpu controller
    (this process's own group under a v1 ``cpu`` mount, or the root of a v2 mount)."""

    version: int
    path: Path

    def __post_init__(self) -> None:
        if self.version not in (1, 2):
            raise ValueError(f"cgroup version must be 1 or 2, got {self.version}")


def find_hierarchy(mounts: Path = Path("/proc/self/mounts"),
                   own_groups: Path = Path("/proc/self/cgroup")) -> Hierarchy:
    """The cgroup hierarchy that holds the cpu controller (v1 first, then v2).

    Raises :class:`QuotaUnavailable` when there is none, or it is mounted read-only.
    """
    try:
        lines = mounts.read_text(encoding="ascii", errors="replace").splitlines()
        groups = own_groups.read_text(encoding="ascii", errors="replace").splitlines()
    except OSError as err:
        raise QuotaUnavailable(f"CPU quotas unavailable: cannot read {err.filename} "
                               f"({err.strerror}); {FALLBACK}") from None
    table = [fields for fields in (line.split() for line in lines) if len(fields) >= 4]
    for _, where, kind, options, *_ in table:
        if kind == "cgroup" and "cpu" in options.split(","):
            nested = Path(where) / _own_v1_cpu_group(groups).lstrip("/")
            return _writable_mount(Hierarchy(1, nested if nested.is_dir() else Path(where)),
                                   options)
    for _, where, kind, options, *_ in table:
        if kind == "cgroup2" and "cpu" in _read(Path(where) / "cgroup.controllers").split():
            return _writable_mount(Hierarchy(2, Path(where)), options)
    raise QuotaUnavailable("CPU quotas unavailable: no cgroup hierarchy with the cpu "
                           f"controller is mounted (v1 'cpu' or v2 with cpu enabled); {FALLBACK}")


def _own_v1_cpu_group(lines: Sequence[str]) -> str:
    """This process's group in the v1 hierarchy of the cpu controller ("" if not listed)."""
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and "cpu" in parts[1].split(","):
            return parts[2]
    return ""


def _writable_mount(hierarchy: Hierarchy, options: str) -> Hierarchy:
    if "ro" in options.split(","):
        raise QuotaUnavailable(f"CPU quotas unavailable: {hierarchy.path} is mounted read-only; "
                               f"{FALLBACK}")
    return hierarchy


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii").strip()
    except OSError:
        return ""


def _write(path: Path, value: str) -> None:
    with open(path, "w", encoding="ascii") as handle:
        handle.write(value)


def usable_cores(hierarchy: Hierarchy | None = None) -> float:
    """Cores this process may use: its CPU affinity, capped by its own group's quota (a
    container's limit), which the workers' groups nest under."""
    cores = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                  else os.cpu_count() or 1)
    if hierarchy is None:
        return cores
    if hierarchy.version == 1:
        quota, period = (_read(hierarchy.path / f"cpu.cfs_{k}_us") for k in ("quota", "period"))
    else:
        quota, _, period = _read(hierarchy.path / "cpu.max").partition(" ")
    try:
        limit = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return cores  # "-1", "max" or no file: unlimited
    return min(cores, limit) if limit > 0 else cores


def own_cpu_limit(mounts: Path = Path("/proc/self/mounts"),
                  own_groups: Path = Path("/proc/self/cgroup")) -> float:
    """Cores this process may use: its affinity, capped by the quota of its own cgroup and
    of every group above it (a container's CPU limit, or a rank's group of
    :class:`QuotaGroups`). The planner's CPU floor divides a worker's CPU per step by it.
    Where the hierarchy cannot be read, the affinity alone."""
    cores = usable_cores()
    try:
        lines = mounts.read_text(encoding="ascii", errors="replace").splitlines()
        groups = own_groups.read_text(encoding="ascii", errors="replace").splitlines()
    except OSError:
        return cores
    v2_group = next((line[3:] for line in groups if line.startswith("0::")), None)
    # every hierarchy that may hold a quota (a hybrid host mounts v1 and v2 side by side)
    for _, where, kind, options, *_ in (f for f in (line.split() for line in lines)
                                        if len(f) >= 4):
        if kind == "cgroup" and "cpu" in options.split(","):
            version, group = 1, _own_v1_cpu_group(groups)
        elif kind == "cgroup2" and v2_group is not None:
            version, group = 2, v2_group
        else:
            continue
        root = Path(where)
        path = root / group.lstrip("/")
        if not path.is_dir():  # a cgroup namespace: the mount is this process's own group
            path = root
        for directory in (path, *path.parents):
            cores = min(cores, usable_cores(Hierarchy(version, directory)))
            if directory == root:
                break
    return cores


def parse_shares(text: str, name: str = ENV_VAR) -> tuple[float, ...]:
    """Comma-separated positive shares (``"1,0.5,0.25"``); ``name`` labels the errors."""
    shares = []
    for part in text.split(","):
        try:
            share = float(part)
        except ValueError:
            raise ValueError(f"{name}={text!r}: {part.strip()!r} is not a number; give one "
                             "CPU share per rank, e.g. 1,0.5,0.25") from None
        if not (math.isfinite(share) and share > 0):
            raise ValueError(f"{name}={text!r}: share {part.strip()} is not valid: every share "
                             "must be a positive number of cores")
        shares.append(share)
    return tuple(shares)


def _fmt(values: Sequence[float]) -> str:
    return ",".join(f"{v:g}" for v in values)


def validate_shares(shares: Sequence[float], cores: float,
                    period_us: int = DEFAULT_PERIOD_US) -> tuple[float, ...]:
    """``shares`` if every one is at least the kernel's minimum quota and they fit the cores.

    The errors name the offending value and what would be valid.
    """
    if not 1_000 <= period_us <= 1_000_000:
        raise ValueError(f"CFS period {period_us} us is out of the kernel's range "
                         "1000-1000000 us")
    if not shares:
        raise ValueError("no CPU shares given: give one per rank, e.g. 1,0.5,0.25")
    least = MIN_QUOTA_US / period_us
    for rank, share in enumerate(shares):
        if not (math.isfinite(share) and share > 0):
            raise ValueError(f"CPU share {share} of rank {rank} is not a positive number")
        if share < least:
            raise ValueError(
                f"CPU share {share:g} of rank {rank} is below the kernel's minimum quota of "
                f"{MIN_QUOTA_US} us per {period_us} us period: give at least {least:g} cores"
            )
    total = math.fsum(shares)
    if total > cores + 1e-9:
        scale = cores / total
        scaled = [math.floor(s * scale * 1000) / 1000 for s in shares]
        raise ValueError(
            f"CPU shares {_fmt(shares)} sum to {total:g} cores but this machine has {cores:g} "
            f"usable: give shares summing to at most {cores:g}, e.g. {_fmt(scaled)} (the "
            f"same ratios x {scale:.3g})"
        )
    return tuple(float(s) for s in shares)


def shares_for_speeds(speeds: Sequence[float], cores: float) -> tuple[float, ...]:
    """CPU shares proportional to ``speeds``: the fastest worker gets a whole core (one torch
    thread cannot use more) unless the sum would exceed ``cores``, then all are scaled down."""
    if not speeds or any(not (math.isfinite(s) and s > 0) for s in speeds):
        raise ValueError(f"speeds must be positive numbers, got {_fmt(speeds)}")
    scale = min(1.0 / max(speeds), cores / math.fsum(speeds))
    # floor to 1e-4 core so rounding never pushes the sum past the cores
    return tuple(math.floor(s * scale * 10_000) / 10_000 for s in speeds)


@dataclass
class QuotaGroups:
    """One job's per-rank quota groups under ``path`` (``rank0``, ``rank1``, ...).

    Use as a context manager: the groups are removed on exit (after the workers have ended).
    """

    hierarchy: Hierarchy
    path: Path
    shares: tuple[float, ...]
    period_us: int

    @classmethod
    def create(cls, shares: Sequence[float], *, hierarchy: Hierarchy | None = None,
               cores: float | None = None,
               period_us: int = DEFAULT_PERIOD_US) -> QuotaGroups:
        """Validate ``shares`` (against ``cores``, default :func:`usable_cores`) and make one
        group per rank. Raises ValueError for bad shares, :class:`QuotaUnavailable` when the
        hierarchy is missing or not writable."""
        hierarchy = hierarchy or find_hierarchy()
        checked = validate_shares(shares, usable_cores(hierarchy) if cores is None else cores,
                                  period_us)
        remove_stale(hierarchy)
        path = hierarchy.path / f"{JOB_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            if hierarchy.version == 2:
                _enable_cpu(hierarchy.path)
            path.mkdir()
        except OSError as err:
            raise QuotaUnavailable(f"CPU quotas unavailable: cannot create a cgroup in "
                                   f"{hierarchy.path} ({err.strerror}); {FALLBACK}") from None
        groups = cls(hierarchy, path, checked, period_us)
        try:
            if hierarchy.version == 1:
                _write(path / "cpu.shares", str(1024 * WEIGHT_FACTOR))
            else:
                _enable_cpu(path)
                _write(path / "cpu.weight", str(100 * WEIGHT_FACTOR))
            for rank, share in enumerate(checked):
                groups._make(rank, share)
        except OSError as err:
            groups.remove()
            raise QuotaUnavailable(f"CPU quotas unavailable: cannot set a quota in {path} "
                                   f"({err.strerror}); {FALLBACK}") from None
        logger.info("CPU quota groups %s: shares %s of a core per %d us period", path,
                    _fmt(checked), period_us)
        return groups

    def _make(self, rank: int, share: float) -> None:
        group = self.group(rank)
        group.mkdir()
        if self.hierarchy.version == 1:
            _write(group / "cpu.cfs_period_us", str(self.period_us))
        _set_quota(group, self.hierarchy.version, share, self.period_us)

    def group(self, rank: int) -> Path:
        """The directory of ``rank``'s group."""
        return _rank_group(self.path, rank)

    def env(self) -> dict[str, str]:
        """The environment variables that let each worker join its group."""
        return {ENV_VAR: _fmt(self.shares), GROUPS_ENV_VAR: str(self.path)}

    def remove(self) -> None:
        """Remove the groups (best effort: a failure is logged, never raised). Processes still
        in a group (a worker that outlived the job) are moved back to the parent group."""
        for group in [*sorted(self.path.glob("rank*")), self.path]:
            _remove_group(group, self.hierarchy.path)

    def __enter__(self) -> QuotaGroups:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.remove()


def _set_quota(group: Path, version: int, share: float, period_us: int) -> None:
    quota = max(MIN_QUOTA_US, round(share * period_us))
    if version == 1:
        _write(group / "cpu.cfs_quota_us", str(quota))
    else:
        _write(group / "cpu.max", f"{quota} {period_us}")


def _enable_cpu(group: Path) -> None:
    """cgroup v2: let ``group``'s children have the cpu controller."""
    if "cpu" not in _read(group / "cgroup.subtree_control").split():
        _write(group / "cgroup.subtree_control", "+cpu")


def _remove_group(group: Path, parent: Path) -> None:
    for pid in _read(group / "cgroup.procs").split():
        try:
            _write(parent / "cgroup.procs", pid)
        except OSError as err:
            if err.errno != errno.ESRCH:  # an exited process needs no move
                logger.warning("could not move process %s out of %s: %s", pid, group,
                               err.strerror)
    try:
        group.rmdir()
    except FileNotFoundError:
        pass
    except OSError as err:
        logger.warning("could not remove CPU quota group %s: %s", group, err.strerror)


def remove_stale(hierarchy: Hierarchy) -> None:
    """Remove groups left by jobs whose creating process is gone (a killed launcher) and
    which hold no process (workers that outlived their launcher keep their quotas)."""
    for job in hierarchy.path.glob(f"{JOB_PREFIX}*"):
        pid = job.name[len(JOB_PREFIX):].split("-", 1)[0]
        if not (job.is_dir() and pid.isdigit()) or Path(f"/proc/{pid}").exists():
            continue
        if not any(_read(group / "cgroup.procs") for group in job.glob("rank*")):
            logger.info("removing stale CPU quota groups %s", job)
            QuotaGroups(hierarchy, job, (), DEFAULT_PERIOD_US).remove()


def join_group(group: Path) -> None:
    """Move this process (all its threads) into ``group``."""
    try:
        _write(group / "cgroup.procs", str(os.getpid()))
    except OSError as err:
        raise QuotaUnavailable(f"cannot join CPU quota group {group} ({err.strerror}); "
                               f"{FALLBACK}") from None


def join_from_env(rank: int, env: Mapping[str, str] | None = None) -> float | None:
    """Join this rank's group named by ``CANNIKIN_CPU_QUOTA`` / ``CANNIKIN_CPU_QUOTA_GROUPS``
    and return its share; None (nothing done) when ``CANNIKIN_CPU_QUOTA`` is unset or empty.
    Call it at the worker's entry point, before the process starts its threads."""
    env = os.environ if env is None else env
    raw = env.get(ENV_VAR, "").strip()
    if not raw:
        return None
    shares = parse_shares(raw)
    if not 0 <= rank < len(shares):
        raise ValueError(f"{ENV_VAR}={raw!r} names {len(shares)} ranks but this is rank {rank}")
    join_group(_group_from_env(rank, env))
    return shares[rank]


def _rank_group(job: Path, rank: int) -> Path:
    """The directory of ``rank``'s group among ``job``'s."""
    return job / f"rank{rank}"


def _group_from_env(rank: int, env: Mapping[str, str]) -> Path:
    """``rank``'s group of the job named by ``CANNIKIN_CPU_QUOTA_GROUPS``; refused by name
    where there is none."""
    where = env.get(GROUPS_ENV_VAR, "").strip()
    if not where:
        raise ValueError(f"{GROUPS_ENV_VAR} is not set, so it has no group for rank {rank}: "
                         "it names the directory of groups that QuotaGroups.create made for "
                         "a job launched on CPU quotas")
    group = _rank_group(Path(where), rank)
    if not group.is_dir():
        raise ValueError(f"{GROUPS_ENV_VAR}={where!r} has no group for rank {rank} ({group} "
                         "is missing): was it made for this job and not yet removed?")
    return group


def change_share(rank: int, share: float, env: Mapping[str, str] | None = None) -> None:
    """Give ``rank``'s group of this job (named by ``CANNIKIN_CPU_QUOTA_GROUPS``) ``share``
    of a core from now on, in the same period: a worker that becomes faster or slower
    while the job runs, as a shared node does. Any rank may change any group (root)."""
    if not (math.isfinite(share) and share > 0):
        raise ValueError(f"share must be a finite number of cores > 0, got {share!r}")
    group = _group_from_env(rank, os.environ if env is None else env)
    if (group / "cpu.cfs_quota_us").exists():
        version, period = 1, _read(group / "cpu.cfs_period_us")
    else:
        version, period = 2, _read(group / "cpu.max").partition(" ")[2]
    if not period.isdigit():
        raise QuotaUnavailable(f"cannot read the CPU period of {group} (got {period!r})")
    if share * int(period) < MIN_QUOTA_US:
        raise ValueError(f"share {share:g} of a {period} us period is under the kernel's "
                         f"minimum quota of {MIN_QUOTA_US} us: give at least "
                         f"{MIN_QUOTA_US / int(period):g}")
    try:
        _set_quota(group, version, share, int(period))
    except OSError as err:
        raise QuotaUnavailable(f"cannot set the CPU quota of {group} ({err.strerror})") from None
