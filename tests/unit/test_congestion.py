"""The machine-wide list of congestion controls namespaces may choose, shared by overlapping
emulated clusters (``aioreduce.bench.congestion``), on files standing in for the sysctl."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from aioreduce.bench import congestion


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    allowed = tmp_path / "tcp_allowed_congestion_control"
    allowed.write_text("reno bbr\n")
    return {"state": tmp_path / "state", "allowed": allowed}


def _list(files: dict[str, Path]) -> list[str]:
    return files["allowed"].read_text().split()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_the_last_cluster_out_puts_the_list_back_not_the_first(
        files: dict[str, Path]) -> None:
    first = congestion.allow("cubic", **files)
    second = congestion.allow("cubic", **files)  # it found cubic there: it added nothing
    assert _list(files) == ["reno", "bbr", "cubic"]
    congestion.release(first, **files)
    assert _list(files) == ["reno", "bbr", "cubic"]  # the second still sets up its hosts
    congestion.release(second, **files)
    assert _list(files) == ["reno", "bbr"]
    assert not (files["state"] / "before").exists()


def test_an_algorithm_the_machine_allows_is_left_as_it_was(files: dict[str, Path]) -> None:
    files["allowed"].write_text("reno cubic\n")
    hold = congestion.allow("cubic", **files)
    congestion.release(hold, **files)
    assert _list(files) == ["reno", "cubic"]


def test_a_killed_runs_hold_is_dropped_and_the_list_put_back(files: dict[str, Path]) -> None:
    hold = congestion.allow("cubic", **files)
    dead = files["state"] / f"{_dead_pid()}-0000"
    hold.holder.rename(dead)  # as a bench killed before its teardown leaves it
    assert congestion.remove_stale(**files) == [dead.name]
    assert _list(files) == ["reno", "bbr"]


def test_a_live_processs_hold_is_kept_by_remove_stale(files: dict[str, Path]) -> None:
    congestion.allow("cubic", **files)
    assert congestion.remove_stale(**files) == []
    assert _list(files) == ["reno", "bbr", "cubic"]


def test_a_new_cluster_after_a_killed_run_restores_the_machines_list_not_the_run_s(
        files: dict[str, Path]) -> None:
    hold = congestion.allow("cubic", **files)
    hold.holder.rename(files["state"] / f"{_dead_pid()}-0000")
    again = congestion.allow("cubic", **files)  # cubic is there, left by the dead run
    congestion.release(again, **files)
    assert _list(files) == ["reno", "bbr"]


def test_a_list_it_cannot_read_is_an_oserror(files: dict[str, Path]) -> None:
    # (Cluster then lets its hosts keep the machine's algorithm, with a warning.)
    with pytest.raises(OSError):
        congestion.allow("cubic", state=files["state"], allowed=files["state"] / "no-such")
