"""``--workers``: a positive count or ``auto``; more than one needs ``--redis-url``."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.cli import parse_settings
from app.cpus import cgroup_cpu_limit, usable_cpus

STATIC = ["--static-endpoints", "127.0.0.2:8000", "--metrics-endpoint-auth=false"]
REDIS = ["--redis-url", "redis://127.0.0.1:6379"]


def test_one_worker_by_default() -> None:
    assert parse_settings(STATIC).workers == 1


def test_a_count_with_redis() -> None:
    assert parse_settings([*STATIC, *REDIS, "--workers", "4"]).workers == 4


def test_auto_is_the_usable_cores() -> None:
    assert parse_settings([*STATIC, *REDIS, "--workers", "auto"]).workers == usable_cpus()


@pytest.mark.parametrize("value", ["0", "-1", "abc", "1.5", ""])
def test_bad_counts_exit_2_naming_the_flag(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_settings([*STATIC, *REDIS, f"--workers={value}"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("epp: --workers")


def test_more_than_one_worker_without_redis_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_settings([*STATIC, "--workers", "2"])
    assert exited.value.code == 2
    assert "epp: --workers 2: workers need --redis-url" in capsys.readouterr().err


def _write(root: Path, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    _write(tmp_path, "cpu.max", "150000 100000")
    assert cgroup_cpu_limit(tmp_path) == pytest.approx(1.5)
    assert usable_cpus(tmp_path) == min(2, usable_cpus(tmp_path / "none"))


def test_cgroup_v2_without_a_limit(tmp_path: Path) -> None:
    _write(tmp_path, "cpu.max", "max 100000")
    assert cgroup_cpu_limit(tmp_path) is None


@pytest.mark.parametrize("directory", ["cpu", "cpu,cpuacct"])
def test_cgroup_v1_quota(tmp_path: Path, directory: str) -> None:
    _write(tmp_path, f"{directory}/cpu.cfs_quota_us", "100000")
    _write(tmp_path, f"{directory}/cpu.cfs_period_us", "100000")
    assert cgroup_cpu_limit(tmp_path) == pytest.approx(1.0)
    assert usable_cpus(tmp_path) == 1


def test_cgroup_v1_without_a_limit(tmp_path: Path) -> None:
    _write(tmp_path, "cpu/cpu.cfs_quota_us", "-1")
    _write(tmp_path, "cpu/cpu.cfs_period_us", "100000")
    assert cgroup_cpu_limit(tmp_path) is None


def test_no_cgroup_files_means_the_affinity_mask(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path) is None
    assert usable_cpus(tmp_path) >= 1
