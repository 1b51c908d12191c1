"""systemd: the unit file shipped with the package, and the daemon's sd_notify (READY, WATCHDOG, STOPPING) over a
real AF_UNIX datagram socket, with the watchdog interval systemd passes (WATCHDOG_USEC, WATCHDOG_PID)."""

from __future__ import annotations

import asyncio
import fnmatch
import itertools
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dimmer.cli import main as dimmer_main
from dimmer.daemon.config import load_config
from dimmer.daemon.loop import DISCOVERY_TIMEOUT_FACTOR, Daemon, SystemdNotifier
from dimmer.daemon.notify import unit_file_text, watchdog_error, watchdog_usec
from dimmer.errors import InputError
from tests.daemon_fakes import FakePlant, loaded_config, small_config
from tests.test_daemon_config import _write

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "dimmer" / "daemon" / "systemd" / "dimmer.service"


def unit_entries(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> every value it is given (systemd allows a key more than once)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out.setdefault(section, {})
            continue
        key, _, value = line.partition("=")
        out[section].setdefault(key, []).append(value)
    return out


# -- the unit file -----------------------------------------------------------------------------------------------------


def test_unit_file_is_shipped_as_package_data() -> None:
    assert unit_file_text() == UNIT.read_text()
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["dimmer"]
    assert any(fnmatch.fnmatch("daemon/systemd/dimmer.service", pattern) for pattern in data)


def test_unit_file_notify_watchdog_restart_and_hardening() -> None:
    unit = unit_entries(unit_file_text())
    svc = {k: v[-1] for k, v in unit["Service"].items()}
    assert svc["Type"] == "notify" and svc["NotifyAccess"] == "main"
    assert svc["ExecStart"].endswith("dimmer run --config /etc/dimmer/site.toml")
    assert svc["ExecStartPre"].endswith("dimmer check /etc/dimmer/site.toml")
    assert svc["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert float(svc["WatchdogSec"]) > 0
    assert svc["Restart"] == "always" and float(svc["RestartSec"]) > 0
    assert svc["RestartPreventExitStatus"] == "2"  # bad input fails the same way every time
    assert svc["KillSignal"] == "SIGTERM" and float(svc["TimeoutStopSec"]) > 0
    assert unit["Unit"]["StartLimitIntervalSec"] == ["0"]
    # a daemon that needs the network and its own state and log directories, nothing else
    assert svc["User"] == "dimmer" and svc["StateDirectory"] == "dimmer" and svc["LogsDirectory"] == "dimmer"
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices", "ProtectKernelTunables"):
        assert svc[key] == "yes", key
    assert svc["ProtectSystem"] == "strict"
    assert svc["CapabilityBoundingSet"] == "" and svc["AmbientCapabilities"] == ""
    assert set(svc["RestrictAddressFamilies"].split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}  # AF_UNIX: sd_notify
    assert svc["IPAddressDeny"] == "any" and svc["IPAddressAllow"] == "localhost"
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_the_units_watchdog_fits_the_example_config() -> None:
    """The shipped WatchdogSec with the shipped example config: a period below half of it, a first cycle within."""
    watchdog_s = float(unit_entries(unit_file_text())["Service"]["WatchdogSec"][-1])
    loaded = load_config(ROOT / "examples" / "site.toml")
    assert watchdog_error(watchdog_s, loaded, 1.0, DISCOVERY_TIMEOUT_FACTOR) is None


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_unit_file_verifies_clean(tmp_path: Path) -> None:
    """systemd-analyze verify: no unknown key, no bad value (the binary's path replaced by one that exists here)."""
    unit = tmp_path / "dimmer.service"
    unit.write_text(unit_file_text().replace("/usr/local/bin/dimmer", shutil.which("true") or "/bin/true"))
    out = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "" and out.stderr.strip() == "", out.stderr


def test_docs_show_the_shipped_unit() -> None:
    doc = (ROOT / "docs" / "daemon.md").read_text()
    section = doc.split("\n## systemd\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```ini\n(.*?)```", section, re.S)
    assert block is not None and block.group(1) == unit_file_text()


# -- WATCHDOG_USEC, WATCHDOG_PID ---------------------------------------------------------------------------------------


def test_watchdog_environment() -> None:
    assert watchdog_usec({}) is None
    assert watchdog_usec({"WATCHDOG_USEC": "10000000"}) == 10_000_000
    assert watchdog_usec({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid())}) == 10_000_000
    assert watchdog_usec({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid() + 1)}) is None  # not ours
    for bad in ("", "0", "-5", "1.5", "10s", " 10", "١٠"):
        with pytest.raises(InputError) as info:
            watchdog_usec({"WATCHDOG_USEC": bad})
        assert info.value.key == "WATCHDOG_USEC" and "\n" not in str(info.value)
        assert str(info.value).startswith("environment: WATCHDOG_USEC: a positive integer")
    with pytest.raises(InputError, match="WATCHDOG_PID"):
        watchdog_usec({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "me"})
    n = SystemdNotifier("", environ={"WATCHDOG_USEC": "2500000"})
    assert n.watchdog_s == 2.5 and not n.watchdog()  # no socket: nothing sent, nothing raised


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = tmp_path / "notify.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(str(path))
    srv.settimeout(5.0)
    try:
        yield srv, str(path)
    finally:
        srv.close()


class Receiver:
    """Reads every datagram sent to `srv` as it arrives (a datagram queue holds only ~10: a reader must keep up),
    with when it arrived (monotonic)."""

    def __init__(self, srv: socket.socket) -> None:
        self.srv = srv
        self.got: list[tuple[float, str]] = []
        srv.settimeout(0.5)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = self.srv.recv(4096)
            except TimeoutError:
                return
            except OSError:
                return
            self.got.append((time.monotonic(), data.decode()))

    def messages(self) -> list[str]:
        self._thread.join(timeout=10.0)
        return [m for _, m in self.got]


def test_watchdog_notified_after_every_cycle_at_least_twice_an_interval(
    notify_socket: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The environment systemd sets (NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID: this process), the daemon's own
    notifier: READY=1, one WATCHDOG=1 a cycle, never two of them further apart than half the interval."""
    srv, path = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")  # 2 s; the period: 20 ms of wall time (1 s at x50)
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    plant = FakePlant()
    d = Daemon(loaded_config(), bus_factory=plant.factory, metrics_address=None, speed=50.0, max_cycles=30)
    assert d.notifier.watchdog_s == 2.0
    rx = Receiver(srv)
    asyncio.run(d.run())
    got = rx.messages()
    assert got[0] == "READY=1\nSTATUS=running"
    assert got[1:-1] == ["WATCHDOG=1"] * 30 and got[-1] == "STOPPING=1"
    pings = [t for t, m in rx.got if m in ("READY=1\nSTATUS=running", "WATCHDOG=1")]
    assert max(b - a for a, b in itertools.pairwise(pings)) < 1.0  # below half the interval


def test_abstract_notify_socket() -> None:
    name = f"dimmer-test-{os.getpid()}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind("\0" + name)
    srv.settimeout(5.0)
    try:
        n = SystemdNotifier("@" + name, environ={})
        assert n.watchdog() and srv.recv(64) == b"WATCHDOG=1"
        n.close()
    finally:
        srv.close()


def test_no_watchdog_after_a_cycle_that_did_not_complete(notify_socket: tuple[socket.socket, str]) -> None:
    srv, path = notify_socket
    plant = FakePlant()
    d = Daemon(
        loaded_config(),
        bus_factory=plant.factory,
        metrics_address=None,
        speed=50.0,
        max_cycles=10,
        notifier=SystemdNotifier(path, environ={"WATCHDOG_USEC": "2000000"}),
    )
    real = d.cycle
    calls = {"n": 0}

    async def cycle() -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("a bug in the loop")
        return await real()

    d.cycle = cycle  # type: ignore[method-assign]
    rx = Receiver(srv)
    with pytest.raises(RuntimeError, match="a bug in the loop"):
        asyncio.run(d.run())
    got = rx.messages()
    assert got == ["READY=1\nSTATUS=running", "WATCHDOG=1", "WATCHDOG=1", "STOPPING=1"]


# -- refused at start-up -----------------------------------------------------------------------------------------------


def test_a_period_the_watchdog_cannot_keep_is_refused_at_start() -> None:
    plant = FakePlant()
    loaded = loaded_config()  # period 1 s, read timeout 0.5 s
    for usec, speed, key in (
        ("2000000", 1.0, "daemon.period_s"),  # 1 s is not below half of 2 s
        ("1000000", 1.0, "daemon.period_s"),
        # a period and a first cycle (10 x 0.5 s of reads, 0.5 s of writes): 6.5 s
        ("6500000", 1.0, "daemon.read_timeout_s"),
        ("100000", 50.0, "daemon.read_timeout_s"),  # at x50: 20 ms < 50 ms, but 20 + 110 ms > 100 ms
    ):
        with pytest.raises(InputError) as info:
            Daemon(
                loaded,
                bus_factory=plant.factory,
                metrics_address=None,
                speed=speed,
                notifier=SystemdNotifier("", environ={"WATCHDOG_USEC": usec}),
            )
        err = info.value
        assert err.key == key and "watchdog" in err.expected and "\n" not in str(err), str(err)
        assert str(err).startswith("test.toml: ")
    # within it: accepted; a watchdog meant for another process: none to keep
    for env in ({"WATCHDOG_USEC": "6600000"}, {"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid() + 1)}):
        d = Daemon(loaded, bus_factory=plant.factory, metrics_address=None, notifier=SystemdNotifier("", environ=env))
        asyncio.run(d.shutdown())


def test_the_command_line_refuses_it_in_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, small_config(daemon={"period_s": 2.0, "metrics_address": ""}))
    monkeypatch.setenv("WATCHDOG_USEC", "3000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert dimmer_main(["run", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"dimmer: {path}: daemon.period_s: below half the systemd watchdog")
    monkeypatch.setenv("WATCHDOG_USEC", "ten seconds")
    assert dimmer_main(["run", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "dimmer: environment: WATCHDOG_USEC: a positive integer number of microseconds (got 'ten seconds')"


def test_a_reload_the_watchdog_cannot_keep_is_refused(tmp_path: Path) -> None:
    async def go() -> None:
        plant = FakePlant()
        raw = small_config()
        path = _write(tmp_path, raw)
        d = Daemon(
            load_config(path),
            config_path=path,
            bus_factory=plant.factory,
            metrics_address=None,
            notifier=SystemdNotifier("", environ={"WATCHDOG_USEC": "7000000"}),
        )
        old = d.loaded
        for daemon in ({"period_s": 3.5}, {"period_s": 2.0, "read_timeout_s": 0.5}, {"read_timeout_s": 0.6}):
            _write(tmp_path, small_config(daemon={**daemon, "metrics_address": ""}))
            assert not await d.reload(), daemon
            assert d.loaded is old
        _write(tmp_path, small_config(daemon={"period_s": 0.5, "metrics_address": ""}))
        assert await d.reload()
        assert d.loaded.config.daemon.period_s == 0.5
        await d.shutdown()

    asyncio.run(go())
