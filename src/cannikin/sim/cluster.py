"""Cluster descriptions: which devices, the network, and scheduled slow-downs.

The same TOML format feeds ``cannikin simulate`` and ``cannikin plan``::

    [network]
    bandwidth_gbps = 10.0     # ring link bandwidth, Gbit/s
    latency_us = 1000.0       # fixed cost of one all-reduce operation

    [[workers]]
    device = "A100"
    count = 4

    [[stragglers]]            # optional: worker slowed by `factor` for a stretch
    worker = 5                # index in the expanded worker list
    factor = 2.0
    start_s = 600.0
    duration_s = 300.0

    [[drift]]                 # optional: worker throttled from `start_s` on
    worker = 0
    factor = 1.3
    start_s = 1800.0
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cannikin.sim.profiles import device

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True, kw_only=True)
class Slowdown:
    """Worker ``worker`` computes ``factor`` times slower during [start_s, start_s + duration_s)."""

    worker: int
    factor: float
    start_s: float = 0.0
    duration_s: float = float("inf")

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"slowdown factor must be > 0, got {self.factor!r}")
        if self.start_s < 0 or not self.duration_s > 0:
            raise ValueError(f"slowdown needs start_s >= 0 and duration_s > 0, got "
                             f"start_s={self.start_s!r}, duration_s={self.duration_s!r}")


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """A cluster: one device name per worker, the network and optional slow-downs."""

    devices: tuple[str, ...]
    bandwidth_gbps: float = 10.0
    """Ring link bandwidth in Gbit/s (the slowest link bounds a ring all-reduce)."""
    latency_us: float = 1000.0
    """Fixed cost per all-reduce operation (one per gradient bucket), microseconds."""
    slowdowns: tuple[Slowdown, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        if len(self.devices) < 1:
            raise ValueError("a cluster needs at least one worker")
        for name in self.devices:
            device(name)  # raises naming the unknown device
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"bandwidth_gbps must be > 0, got {self.bandwidth_gbps!r}")
        if self.latency_us < 0:
            raise ValueError(f"latency_us must be >= 0, got {self.latency_us!r}")
        for s in self.slowdowns:
            if not 0 <= s.worker < len(self.devices):
                raise ValueError(f"slowdown worker {s.worker} out of range: the cluster has "
                                 f"workers 0..{len(self.devices) - 1}")

    @property
    def num_workers(self) -> int:
        return len(self.devices)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    def summary(self) -> str:
        """'4x A100 + 4x V100, 10 Gb/s' style description."""
        counts: dict[str, int] = {}
        for name in self.devices:
            counts[device(name).name] = counts.get(device(name).name, 0) + 1
        mix = " + ".join(f"{c}x {d}" for d, c in counts.items())
        return f"{mix}, {self.bandwidth_gbps:g} Gb/s"


def _expect_keys(table: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = set(table) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; "
                         f"valid keys: {', '.join(sorted(allowed))}")


def _number(table: dict[str, Any], key: str, where: str, default: float | None = None) -> float:
    if key not in table:
        if default is None:
            raise ValueError(f"{where}: missing {key!r}")
        return default
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)


def spec_from_dict(data: dict[str, Any], name: str = "") -> ClusterSpec:
    """Build a ClusterSpec from parsed TOML (see the module docstring for the format)."""
    _expect_keys(data, {"network", "workers", "stragglers", "drift"}, "cluster")
    workers = data.get("workers")
    if not isinstance(workers, list) or not workers:
        raise ValueError("cluster: needs a non-empty [[workers]] list of "
                         "{device = \"A100\", count = 4} entries")
    devices: list[str] = []
    for k, entry in enumerate(workers):
        where = f"workers[{k}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a table like {{device = \"A100\", count = 4}}")
        _expect_keys(entry, {"device", "count"}, where)
        if not isinstance(entry.get("device"), str):
            raise ValueError(f"{where}: missing device name (e.g. device = \"A100\")")
        count = entry.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{where}: count must be an integer >= 1, got {count!r}")
        device(entry["device"])
        devices += [entry["device"]] * count
    network = data.get("network", {})
    _expect_keys(network, {"bandwidth_gbps", "latency_us"}, "network")
    slowdowns = []
    for key, forever in (("stragglers", False), ("drift", True)):
        for k, entry in enumerate(data.get(key, [])):
            where = f"{key}[{k}]"
            allowed = {"worker", "factor", "start_s"} | (set() if forever else {"duration_s"})
            _expect_keys(entry, allowed, where)
            worker = entry.get("worker")
            if isinstance(worker, bool) or not isinstance(worker, int):
                raise ValueError(f"{where}: worker must be an integer index, got {worker!r}")
            slowdowns.append(Slowdown(
                worker=worker,
                factor=_number(entry, "factor", where, 2.0),
                start_s=_number(entry, "start_s", where, 0.0),
                duration_s=(float("inf") if forever
                            else _number(entry, "duration_s", where)),
            ))
    return ClusterSpec(
        devices=tuple(devices),
        bandwidth_gbps=_number(network, "bandwidth_gbps", "network", 10.0),
        latency_us=_number(network, "latency_us", "network", 1000.0),
        slowdowns=tuple(slowdowns),
        name=name,
    )


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read a cluster TOML file; errors name the file and what is wrong."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"cluster file {str(path)!r} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read cluster file {str(path)!r}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"cluster file {str(path)!r} is not valid TOML: {exc}") from None
    try:
        return spec_from_dict(data, name=path.stem)
    except ValueError as exc:
        raise ValueError(f"cluster file {str(path)!r}: {exc}") from None


def _mix(counts: dict[str, int]) -> tuple[str, ...]:
    return tuple(name for name, count in counts.items() for _ in range(count))


#: Built-in scenarios. "paper16" resembles the Cannikin paper's testbed (16 GPUs of mixed
#: generations on Chameleon Cloud, arXiv 2402.05302); the exact mix is not in the sources
#: available here, so it uses four each of the GPU types Chameleon offers (A100 PCIe, V100,
#: Quadro RTX 6000, P100) over a 25 Gb/s Ethernet ring (the network is not given either).
SCENARIOS: dict[str, ClusterSpec] = {
    "paper16": ClusterSpec(
        devices=_mix({"A100": 4, "V100": 4, "RTX6000": 4, "P100": 4}),
        bandwidth_gbps=25.0, latency_us=1000.0, name="paper16"),
    "paper16-straggler": ClusterSpec(
        devices=_mix({"A100": 4, "V100": 4, "RTX6000": 4, "P100": 4}),
        bandwidth_gbps=25.0, latency_us=1000.0, name="paper16-straggler",
        slowdowns=(Slowdown(worker=0, factor=2.0, start_s=600.0, duration_s=1200.0),
                   Slowdown(worker=5, factor=1.5, start_s=1800.0))),
    "homogeneous16": ClusterSpec(
        devices=_mix({"V100": 16}), bandwidth_gbps=10.0, latency_us=1000.0,
        name="homogeneous16"),
    "cloud64": ClusterSpec(
        devices=_mix({"H100": 8, "A100": 16, "A10": 16, "T4": 24}),
        bandwidth_gbps=25.0, latency_us=2000.0, name="cloud64"),
    "scale1024": ClusterSpec(
        devices=_mix({"H100": 128, "A100": 256, "V100": 256, "A10": 128, "T4": 256}),
        bandwidth_gbps=100.0, latency_us=5000.0, name="scale1024"),
}


def cluster_from_arg(value: str) -> ClusterSpec:
    """A built-in scenario name or a path to a cluster TOML file."""
    if value in SCENARIOS:
        return SCENARIOS[value]
    if value.endswith(".toml") or Path(value).exists():
        return load_cluster(value)
    raise ValueError(f"unknown cluster {value!r}: give a cluster TOML file or one of the "
                     f"scenarios {', '.join(SCENARIOS)}")
