"""Issue 12, item 5: `dimmer run --sim` as a command, in a process of its own, on the smallest scenario.

Files: with a relative --out (the default is one) the audit log and state file are in <out>/, never <out>/<out>/,
and a rerun into the same --out starts fresh (no state restored, a new audit log). The end: the daemon stops when
the plant says its run ended, before it could take the plant's frozen registers for stale devices. A kill: SIGKILL
of `dimmer run --sim` takes the plant child with it, and the child writes no report of a run nobody controlled.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dimmer.cli import plant_outputs_or_stop

from .conftest import MINIMAL_SCENARIO

# 20 plant seconds at 5x: 4 s of wall time, and a 2 s wall margin (stale_s = 10 plant s) for a busy machine
SHORT = ["--set", "duration_s=20", "--speed", "5", "--quiet"]
DIMMER = [sys.executable, "-c", "import sys; from dimmer.cli import main; raise SystemExit(main(sys.argv[1:]))"]


def _run_sim(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DIMMER, "run", "--sim", "sc.toml", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _audit(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_relative_out_holds_the_audit_and_state_and_a_rerun_starts_fresh(tmp_path: Path) -> None:
    (tmp_path / "sc.toml").write_text(MINIMAL_SCENARIO)
    for attempt in (1, 2):
        done = _run_sim(tmp_path, *SHORT, "--out", "rel/out")
        assert done.returncode == 0, done.stderr[-2000:]
        out = tmp_path / "rel" / "out"
        assert (out / "audit.jsonl").is_file() and (out / "state.json").is_file()
        assert not (out / "rel").exists()  # was out/<out>/audit.jsonl
        assert (out / "summary.json").is_file()
        # a rerun restores nothing and starts its own audit: one run's records, one end
        assert "no state file at" in done.stderr, (attempt, done.stderr[-2000:])
        audit = _audit(out / "audit.jsonl")
        assert [r for r in audit if r.get("event") == "plant_ended"] == [audit[-1]]
        numbers = [r["cycle"] for r in audit if "cycle" in r]
        assert numbers == list(range(1, len(numbers) + 1))  # one run's cycles, not two runs' appended
        # the end: the plant said so, and the daemon stopped on it with its devices as fresh as ever
        assert audit[-1]["event"] == "plant_ended" and audit[-1]["t_s"] == 20
        last = [r for r in audit if "cycle" in r][-1]
        assert last["mode"] == "running" and last["stale"] == []
        stats = json.loads((out / "daemon.json").read_text())
        assert stats["end"] == "plant ended" and stats["stale_at_end"] == [] and stats["last_cycle_mode"] == "running"
        assert stats["plant_exit_status"] == 0
        assert "stale" not in done.stderr and "fail-safe" not in done.stderr and "failsafe" not in done.stderr


@pytest.mark.slow
def test_the_default_out_is_used_as_given(tmp_path: Path) -> None:
    (tmp_path / "sc.toml").write_text(MINIMAL_SCENARIO)
    done = _run_sim(tmp_path, "--set", "duration_s=5", "--speed", "5", "--quiet")
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "out" / "tiny-daemon"
    assert (out / "audit.jsonl").is_file() and (out / "state.json").is_file() and not (out / "out").exists()
    assert f"wrote {out}/summary.json" in done.stdout


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4, after the command in parentheses
                kids.append(int(entry.name))
    return kids


def _gone(pid: int) -> bool:
    """Not running: no such process, or a zombie not yet reaped (PID 1 in a container may never reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the plant child through /proc")
def test_sigkill_of_run_sim_takes_the_plant_child_with_it(tmp_path: Path) -> None:
    (tmp_path / "sc.toml").write_text(MINIMAL_SCENARIO)
    out = tmp_path / "o"
    parent = subprocess.Popen(
        [*DIMMER, "run", "--sim", "sc.toml", "--set", "duration_s=600", "--speed", "1", "--quiet", "--out", "o"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    kids: list[int] = []
    try:
        t0 = time.monotonic()  # until the daemon runs against the plant: a cycle in its audit
        while not ((out / "audit.jsonl").is_file() and '"cycle"' in (out / "audit.jsonl").read_text()):
            assert parent.poll() is None, "dimmer run --sim ended early"
            assert time.monotonic() - t0 < 90, "the daemon never ran a cycle"
            time.sleep(0.2)
        kids = _children(parent.pid)
        assert len(kids) == 1, kids
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        t0 = time.monotonic()
        while not _gone(kids[0]):
            assert time.monotonic() - t0 < 30, "the plant child outlived its parent"
            time.sleep(0.1)
        # and it wrote no report of the run: the daemon was gone
        assert not (out / "summary.json").exists() and not (out / "serve.json").exists()
        assert "the daemon that started this plant is gone" in (out / "serve.log").read_text()
    finally:
        if parent.poll() is None:
            parent.kill()
        for k in kids:
            if not _gone(k):
                os.kill(k, signal.SIGKILL)


async def _slow_plant(code: str) -> asyncio.subprocess.Process:
    """A child process standing in for a plant writing its outputs: it exits after `code` runs."""
    return await asyncio.create_subprocess_exec(sys.executable, "-c", code)


def test_ctrl_c_while_the_plant_writes_its_outputs_abandons_them() -> None:
    """After the daemon stopped, its own stop handlers did nothing: Ctrl-C waited out a long run's figures (up to
    ten minutes). Now a SIGINT then terminates the plant at once: its outputs are abandoned, the answer says so."""

    async def go() -> tuple[bool, float, int | None]:
        proc = await _slow_plant("import time; time.sleep(120)")
        asyncio.get_running_loop().call_later(0.3, os.kill, os.getpid(), signal.SIGINT)
        t0 = time.monotonic()
        exited = await plant_outputs_or_stop(proc, 120.0, on_signals=True)
        return exited, time.monotonic() - t0, proc.returncode

    exited, took_s, status = asyncio.run(go())
    assert not exited and status == -signal.SIGTERM
    assert took_s < 30.0  # not the plant's 120 s


def test_a_plant_that_writes_its_outputs_is_waited_for_and_one_that_hangs_is_ended() -> None:
    async def go() -> tuple[bool, int | None, bool, int | None]:
        done = await _slow_plant("import time; time.sleep(0.2)")
        finished = await plant_outputs_or_stop(done, 60.0, on_signals=True)
        hung = await _slow_plant("import time; time.sleep(120)")
        waited = await plant_outputs_or_stop(hung, 0.5, on_signals=False)
        return finished, done.returncode, waited, hung.returncode

    finished, status, waited, hung_status = asyncio.run(go())
    assert finished and status == 0
    # past the wait the plant is ended, and its exit status (not a stop we were asked for) says it failed
    assert waited and hung_status == -signal.SIGTERM
