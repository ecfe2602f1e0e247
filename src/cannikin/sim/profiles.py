"""Device and workload profiles: the published figures the simulator's ground truth is built on.

The numbers live in ``data/devices.toml`` and ``data/workloads.toml`` with their sources and
derivations; this module only loads and validates them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

#: Fraction of device memory usable for training (the rest: CUDA context, fragmentation).
USABLE_MEMORY_FRACTION = 0.9


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """One GPU model."""

    name: str
    memory_gb: float
    """Device memory."""
    memory_bandwidth_gbs: float
    """Device memory bandwidth (the optimiser step is bandwidth bound)."""
    relative_speed: float
    """Saturated training throughput relative to a V100 16 GB in FP32."""
    source: str = ""

    def __post_init__(self) -> None:
        for field in ("memory_gb", "memory_bandwidth_gbs", "relative_speed"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"device {self.name!r}: {field} must be > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One model + data set: its compute, communication, memory and convergence profile."""

    name: str
    description: str
    params: int
    """Parameter count; gradients are all-reduced in FP32 (4 bytes each)."""
    v100_samples_per_s: float
    forward_fraction: float
    knee_v100: float
    """Batch at which a V100 reaches 1/sqrt(2) of its saturated throughput."""
    overhead_ms: float
    state_bytes_per_param: int
    """Weights + gradients + optimiser state per parameter (memory, optimiser-step traffic)."""
    activation_mb_per_sample: float
    buckets: tuple[tuple[float, float], ...]
    """(ready fraction of the backward pass, fraction of the gradient bytes) per bucket."""
    init_batch: int
    max_batch: int
    dataset_size: int
    target_epochs: float
    noise_scale_start: float
    noise_scale_end: float

    def __post_init__(self) -> None:
        positive = ("params", "v100_samples_per_s", "knee_v100", "state_bytes_per_param",
                    "activation_mb_per_sample", "init_batch", "max_batch", "dataset_size",
                    "target_epochs", "noise_scale_start", "noise_scale_end")
        for field in positive:
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"workload {self.name!r}: {field} must be > 0, got {value!r}")
        if not 0 < self.forward_fraction < 1:
            raise ValueError(f"workload {self.name!r}: forward_fraction must be in (0, 1), "
                             f"got {self.forward_fraction!r}")
        if self.max_batch < self.init_batch:
            raise ValueError(f"workload {self.name!r}: max_batch {self.max_batch} < "
                             f"init_batch {self.init_batch}")
        ready = [r for r, _ in self.buckets]
        share = sum(s for _, s in self.buckets)
        if not self.buckets or ready != sorted(ready) or ready[-1] != 1.0 or ready[0] <= 0:
            raise ValueError(f"workload {self.name!r}: bucket ready fractions must increase "
                             f"and end at 1.0, got {ready}")
        if abs(share - 1.0) > 1e-6:
            raise ValueError(f"workload {self.name!r}: bucket byte fractions must sum to 1, "
                             f"got {share:.4f}")

    @property
    def gradient_bytes(self) -> float:
        return 4.0 * self.params

    @property
    def target_samples(self) -> float:
        """Samples at statistical efficiency 1 needed to reach the target."""
        return self.target_epochs * self.dataset_size

    def max_local_batch(self, device: DeviceProfile) -> int:
        """Largest local batch that fits in the device's memory (0 if the model does not)."""
        free_mb = (device.memory_gb * USABLE_MEMORY_FRACTION * 1024
                   - self.params * self.state_bytes_per_param / 2**20)
        return max(int(free_mb // self.activation_mb_per_sample), 0)


def normalize_device_name(name: str) -> str:
    """'rtx 6000', 'RTX-6000' and 'RTX6000' all name the same device."""
    return "".join(ch for ch in name.upper() if ch.isalnum())


def _load(filename: str) -> dict[str, Any]:
    text = resources.files("cannikin.sim").joinpath("data", filename).read_text("utf-8")
    return tomllib.loads(text)


@cache
def devices() -> dict[str, DeviceProfile]:
    """All built-in device profiles by normalised name."""
    return {normalize_device_name(name): DeviceProfile(name=name, **fields)
            for name, fields in _load("devices.toml").items()}


@cache
def workloads() -> dict[str, Workload]:
    """All built-in workloads by name."""
    out = {}
    for name, fields in _load("workloads.toml").items():
        buckets = tuple((float(r), float(s)) for r, s in fields.pop("buckets"))
        out[name] = Workload(name=name, buckets=buckets, **fields)
    return out


def device(name: str) -> DeviceProfile:
    """The profile of one device, or a ValueError listing the known ones."""
    known = devices()
    key = normalize_device_name(name)
    if key not in known:
        raise ValueError(f"unknown device {name!r}; known devices: "
                         f"{', '.join(d.name for d in known.values())}")
    return known[key]


def workload(name: str) -> Workload:
    """One workload, or a ValueError listing the known ones."""
    known = workloads()
    if name not in known:
        raise ValueError(f"unknown workload {name!r}; known workloads: {', '.join(known)}")
    return known[name]
