"""Cluster simulator: policies compared on a ground-truth heterogeneous cluster (numpy only).

The ground truth (:mod:`cannikin.sim.truth`) is built from published device figures
(:mod:`cannikin.sim.profiles`); policies (:mod:`cannikin.sim.policies`) see only simulated
measurements and plan with the project's real planner code; :mod:`cannikin.sim.engine`
runs them to a training target.
"""

from cannikin.sim.cluster import SCENARIOS, ClusterSpec, Slowdown, cluster_from_arg, load_cluster
from cannikin.sim.engine import Comparison, RunResult, SimConfig, compare, run_policy
from cannikin.sim.policies import POLICY_NAMES
from cannikin.sim.profiles import device, devices, workload, workloads
from cannikin.sim.truth import GroundTruth, NoiseConfig

__all__ = [
    "POLICY_NAMES", "SCENARIOS", "ClusterSpec", "Comparison", "GroundTruth", "NoiseConfig",
    "RunResult", "SimConfig", "Slowdown", "cluster_from_arg", "compare", "device", "devices",
    "load_cluster", "run_policy", "workload", "workloads",
]
