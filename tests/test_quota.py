"""CPU-quota groups (runtime/quota.py): parsing, validation, hierarchy discovery and group
files on fake directories (run everywhere), and two real quota workers where cgroups are
writable."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from cannikin.runtime import quota
from cannikin.runtime.quota import (
    GROUPS_ENV_VAR,
    Hierarchy,
    QuotaGroups,
    QuotaUnavailable,
    find_hierarchy,
    join_from_env,
    parse_shares,
    shares_for_speeds,
    validate_shares,
)
from dist_utils import WORKERS, run_torchrun


def test_parse_shares_and_its_errors_name_the_bad_part() -> None:
    assert parse_shares("1, 0.5,0.25") == (1.0, 0.5, 0.25)
    with pytest.raises(ValueError, match=r"'half' is not a number"):
        parse_shares("1,half")
    with pytest.raises(ValueError, match=r"share -0.5 is not valid"):
        parse_shares("1,-0.5")


def test_shares_over_the_cores_are_refused_with_a_valid_alternative() -> None:
    with pytest.raises(ValueError) as info:
        validate_shares((1.0, 1.0, 0.5), cores=2)
    message = str(info.value)
    assert "1,1,0.5 sum to 2.5 cores" in message and "at most 2" in message
    suggested = message.split("e.g. ")[1].split(" ")[0]
    assert suggested == "0.8,0.8,0.4"
    assert validate_shares(parse_shares(suggested), cores=2) == (0.8, 0.8, 0.4)
    assert validate_shares((1.0, 0.5, 0.25), cores=2) == (1.0, 0.5, 0.25)


def test_a_share_below_the_kernels_minimum_quota_is_refused() -> None:
    with pytest.raises(ValueError, match=r"share 0.05 of rank 1 .* at least 0.1 cores"):
        validate_shares((1.0, 0.05), cores=2, period_us=10_000)
    assert validate_shares((1.0, 0.05), cores=2, period_us=100_000) == (1.0, 0.05)
    with pytest.raises(ValueError, match=r"period 500 us"):
        validate_shares((1.0,), cores=2, period_us=500)


def test_shares_follow_the_speeds_and_fit_the_cores() -> None:
    assert shares_for_speeds((1, 1, 2, 4), cores=2) == (0.25, 0.25, 0.5, 1.0)
    assert shares_for_speeds((1, 2), cores=2) == (0.5, 1.0)  # one thread: at most a core
    shares = shares_for_speeds((1, 1, 1, 3), cores=2)  # sum 6 > 2 cores at 1/3: scaled
    assert sum(shares) <= 2 and shares[3] == pytest.approx(3 * shares[0], rel=1e-3)


def _mounts(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "mounts"
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def test_find_hierarchy_v1_nested_v2_and_none(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu"
    (cpu / "job").mkdir(parents=True)
    own = tmp_path / "cgroup"
    own.write_text("2:cpuacct:/\n1:cpu:/job\n0::/\n")
    mounts = _mounts(tmp_path, f"cgroup {cpu} cgroup rw,relatime,cpu 0 0")
    assert find_hierarchy(mounts, own) == Hierarchy(1, cpu / "job")
    unified = tmp_path / "unified"
    unified.mkdir()
    (unified / "cgroup.controllers").write_text("cpuset cpu io memory\n")
    mounts = _mounts(tmp_path, f"cgroup2 {unified} cgroup2 rw,relatime 0 0")
    assert find_hierarchy(mounts, own) == Hierarchy(2, unified)
    (unified / "cgroup.controllers").write_text("hugetlb\n")  # cpu bound elsewhere
    with pytest.raises(QuotaUnavailable, match="no cgroup hierarchy .* fall back to the "
                                               "sleep-padding emulation"):
        find_hierarchy(mounts, own)
    ro = _mounts(tmp_path, f"cgroup {cpu} cgroup ro,relatime,cpu 0 0")
    with pytest.raises(QuotaUnavailable, match="mounted read-only; fall back"):
        find_hierarchy(ro, own)


def _quota_dir(path: Path, version: int, cores: float | None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if version == 1:
        (path / "cpu.cfs_period_us").write_text("100000\n")
        quota = -1 if cores is None else int(cores * 100000)
        (path / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    else:
        quota_text = "max" if cores is None else str(int(cores * 100000))
        (path / "cpu.max").write_text(f"{quota_text} 100000\n")


@pytest.mark.parametrize("version", [1, 2])
def test_own_cpu_limit_is_the_tightest_quota_above_the_process(tmp_path: Path,
                                                               version: int) -> None:
    """A container's limit above a rank's group caps it; no quota anywhere: the affinity."""
    root = tmp_path / "cg"
    _quota_dir(root, version, None)
    _quota_dir(root / "pod", version, 0.75)
    _quota_dir(root / "pod" / "job", version, None)
    _quota_dir(root / "pod" / "job" / "rank1", version, 0.25)
    kind = "cgroup rw,relatime,cpu" if version == 1 else "cgroup2 rw,relatime"
    mounts = _mounts(tmp_path, f"{kind.split()[0]} {root} {kind} 0 0")
    own = tmp_path / "cgroup"
    line = "1:cpu:" if version == 1 else "0::"
    own.write_text(f"{line}/pod/job/rank1\n")
    assert quota.own_cpu_limit(mounts, own) == 0.25
    own.write_text(f"{line}/pod/job\n")
    assert quota.own_cpu_limit(mounts, own) == 0.75
    own.write_text(f"{line}/elsewhere\n")  # not under the mount (a namespace): its root
    assert quota.own_cpu_limit(mounts, own) == quota.usable_cores()
    _quota_dir(root, version, 0.5)
    assert quota.own_cpu_limit(mounts, own) == 0.5
    assert quota.own_cpu_limit(tmp_path / "missing", own) == quota.usable_cores()


def test_own_cpu_limit_on_a_hybrid_host_reads_the_v1_quota(tmp_path: Path) -> None:
    """v2 mounted first without the cpu controller, v1's cpu holding the quota."""
    unified, cpu = tmp_path / "unified", tmp_path / "cpu"
    (unified / "job").mkdir(parents=True)
    _quota_dir(cpu / "job", 1, 0.25)
    mounts = _mounts(tmp_path, f"cgroup2 {unified} cgroup2 rw,relatime 0 0",
                     f"cgroup {cpu} cgroup rw,relatime,cpu 0 0")
    own = tmp_path / "cgroup"
    own.write_text("1:cpu:/job\n0::/job\n")
    assert quota.own_cpu_limit(mounts, own) == 0.25


@pytest.mark.parametrize("version", [1, 2])
def test_groups_are_made_with_the_quotas_and_joined_by_rank(tmp_path: Path,
                                                            version: int) -> None:
    groups = QuotaGroups.create((1.0, 0.25), hierarchy=Hierarchy(version, tmp_path), cores=2)
    assert groups.path.parent == tmp_path and groups.path.name.startswith("cannikin-")
    slow = groups.group(1)
    if version == 1:
        assert (groups.path / "cpu.shares").read_text() == "10240"
        assert (slow / "cpu.cfs_period_us").read_text() == "10000"
        assert (slow / "cpu.cfs_quota_us").read_text() == "2500"
    else:
        assert (slow / "cpu.max").read_text() == "2500 10000"
        assert (groups.path / "cgroup.subtree_control").read_text() == "+cpu"
        assert (groups.path / "cpu.weight").read_text() == "1000"
    env = groups.env()
    assert env == {"CANNIKIN_CPU_QUOTA": "1,0.25", GROUPS_ENV_VAR: str(groups.path)}
    assert join_from_env(1, env) == 0.25
    assert (slow / "cgroup.procs").read_text() == str(os.getpid())


@pytest.mark.parametrize("version", [1, 2])
def test_a_share_changed_while_the_job_runs_keeps_its_period(tmp_path: Path,
                                                             version: int) -> None:
    groups = QuotaGroups.create((1.0, 0.25), hierarchy=Hierarchy(version, tmp_path), cores=2,
                                period_us=20_000)
    quota.change_share(1, 1.0, groups.env())
    quota.change_share(0, 0.25, groups.env())
    if version == 1:
        assert (groups.group(1) / "cpu.cfs_quota_us").read_text() == "20000"
        assert (groups.group(0) / "cpu.cfs_quota_us").read_text() == "5000"
        assert (groups.group(0) / "cpu.cfs_period_us").read_text() == "20000"
    else:
        assert (groups.group(1) / "cpu.max").read_text() == "20000 20000"
        assert (groups.group(0) / "cpu.max").read_text() == "5000 20000"
    with pytest.raises(ValueError, match="share must be a finite number of cores > 0, got 0"):
        quota.change_share(0, 0.0, groups.env())
    with pytest.raises(ValueError, match="share 0.01 of a 20000 us period is under the "
                                         "kernel's minimum quota of 1000 us: give at least 0.05"):
        quota.change_share(0, 0.01, groups.env())
    with pytest.raises(ValueError, match="has no group for rank 2"):
        quota.change_share(2, 0.5, groups.env())
    with pytest.raises(ValueError, match="has no group for rank 0"):
        quota.change_share(0, 0.5, {})


def test_join_from_env_errors_and_the_unset_case(tmp_path: Path) -> None:
    assert join_from_env(0, {}) is None
    assert join_from_env(0, {"CANNIKIN_CPU_QUOTA": " "}) is None
    with pytest.raises(ValueError, match="names 2 ranks but this is rank 2"):
        join_from_env(2, {"CANNIKIN_CPU_QUOTA": "1,0.5"})
    with pytest.raises(ValueError, match=f"{GROUPS_ENV_VAR} is not"):
        join_from_env(0, {"CANNIKIN_CPU_QUOTA": "1,0.5"})
    with pytest.raises(ValueError, match="no group for rank 1"):
        join_from_env(1, {"CANNIKIN_CPU_QUOTA": "1,0.5", GROUPS_ENV_VAR: str(tmp_path)})


def test_an_unwritable_hierarchy_is_one_line_naming_the_fallback(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "cpu"
    not_a_dir.write_text("")  # mkdir under it fails as it would on a read-only cgroupfs
    with pytest.raises(QuotaUnavailable) as info:
        QuotaGroups.create((1.0, 0.5), hierarchy=Hierarchy(1, not_a_dir), cores=2)
    message = str(info.value)
    assert "\n" not in message and f"cannot create a cgroup in {not_a_dir}" in message
    assert "fall back to the sleep-padding emulation (CANNIKIN_SLOWDOWN" in message
    if os.geteuid() != 0:  # root writes through file permissions, so only a user sees this
        readonly = tmp_path / "readonly"
        readonly.mkdir(mode=0o555)
        with pytest.raises(QuotaUnavailable, match="Permission denied"):
            QuotaGroups.create((1.0,), hierarchy=Hierarchy(1, readonly), cores=2)


def test_stale_groups_of_a_dead_launcher_are_removed(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    dead = tmp_path / "cannikin-999999999-abcd"
    (dead / "rank0").mkdir(parents=True)
    alive = tmp_path / f"cannikin-{os.getpid()}-abcd"
    alive.mkdir()
    orphans = tmp_path / "cannikin-999999998-abcd" / "rank0"  # workers still running in it
    orphans.mkdir(parents=True)
    (orphans / "cgroup.procs").write_text("12345\n")
    with caplog.at_level(logging.INFO, logger=quota.__name__):
        quota.remove_stale(Hierarchy(1, tmp_path))
    assert not dead.exists() and alive.exists() and orphans.exists()
    assert "removing stale CPU quota groups" in caplog.text


def test_two_quota_workers_the_slower_is_measured_slower() -> None:
    """Shares 1 and 0.25 of a core: rank 1's compute on the same batch takes longer
    (generous bound: 1.5x, against ~4x on an idle machine)."""
    try:
        groups = QuotaGroups.create((1.0, 0.25))
    except QuotaUnavailable as err:
        pytest.skip(str(err))
    with groups:
        result = run_torchrun(WORKERS / "quota_worker.py", nproc=2, env=groups.env(),
                              timeout_s=90)
    assert not groups.path.exists()
    result.check()
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["shares"] == [1.0, 0.25]
    assert [Path(g).parts[-2:] for g in report["groups"]] == [
        (groups.path.name, f"rank{r}") for r in range(2)]
    fast, slow = report["compute_s"]
    assert slow > 1.5 * fast, report
    assert report["cpu_limits"] == [1.0, 0.25]
