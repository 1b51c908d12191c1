"""Every listener that cannot listen says so in one line naming host:port and why, exit status 2 (issue 12, item 8):
`dimmer agent`, `gridsim serve`, the daemon's Prometheus endpoint (`dimmer run --config`), for a port in use, a
host that does not resolve, an address not on this host, a port out of range and a port below 1024 without root.
Real sockets on loopback; the commands run as the user runs them (their `main`, or a child process)."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dimmer.cli import main as dimmer_main
from dimmer.daemon.agent import CapAgent
from dimmer.daemon.metrics import DaemonMetrics
from dimmer.daemon.netguard import listen_error
from dimmer.daemon.nvml import SimulatedGpus
from dimmer.errors import InputError, ListenError
from gridsim.serve import PlantServer, main_serve
from tests.daemon_fakes import loaded_config
from tests.test_serve import scenario

REPO = Path(__file__).resolve().parents[1]
NO_SUCH_HOST = "no-such-host.invalid"  # RFC 6761: never resolves
NOT_HERE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): an address no host of ours has


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("host", "why"),
    [("127.0.0.1", "address already in use"), (NO_SUCH_HOST, "no such host"), (NOT_HERE, "no such address")],
)
def test_agent_and_gridsim_serve_that_cannot_listen_exit_2_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], taken_port: int, host: str, why: str
) -> None:
    scenario(tmp_path)
    for prog, run in (
        ("dimmer", lambda: dimmer_main(["agent", "--sim-gpus", "2", "--host", host, "--port", str(taken_port)])),
        ("gridsim", lambda: main_serve([str(tmp_path / "eight.toml"), "--host", host, "--port", str(taken_port)])),
    ):
        assert run() == 2, prog
        line = one_line(capsys.readouterr().err)
        assert line.startswith(f"{prog}: cannot listen on {host}:{taken_port}: {why}"), line


def test_the_metrics_endpoint_that_cannot_listen_exits_2_in_one_line(tmp_path: Path, taken_port: int) -> None:
    text = (REPO / "examples" / "site.toml").read_text()
    text = re.sub(r"(?m)^metrics_address = .*$", f'metrics_address = "127.0.0.1:{taken_port}"', text)
    text = re.sub(r"(?m)^audit_log = .*$", f'audit_log = "{tmp_path / "audit.jsonl"}"', text)
    text = re.sub(r"(?m)^state_file = .*$", f'state_file = "{tmp_path / "state.json"}"', text)
    (tmp_path / "site.toml").write_text(text)
    cmd = [sys.executable, "-m", "dimmer.cli", "run", "--config", str(tmp_path / "site.toml")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "dimmer:" in ln and " INFO " not in ln]
    assert lines == [f"dimmer: cannot listen on 127.0.0.1:{taken_port}: address already in use (another process "
                     "listens on that port)"], r.stderr  # fmt: skip
    assert "Traceback" not in r.stderr


def test_every_listener_raises_one_listen_error(tmp_path: Path, taken_port: int) -> None:
    """The servers themselves (what the commands call): a ListenError, an InputError, never pymodbus's RuntimeError."""

    async def go() -> list[str]:
        out = []
        loaded = scenario(tmp_path)
        for host, port in (("127.0.0.1", taken_port), (NO_SUCH_HOST, 0), ("127.0.0.1", 70000)):
            servers: list[Any] = [CapAgent(SimulatedGpus(1), safe_cap_w=840.0).server]
            if port <= 65535:  # the plant refuses a port out of range when it is made (test_serve)
                servers.append(PlantServer(loaded, host=host, port=port))
            for server in servers:
                with pytest.raises(ListenError) as e:
                    await (server.start() if isinstance(server, PlantServer) else server.start(host, port))
                assert isinstance(e.value, InputError)
                out.append(str(e.value))
        return out

    got = asyncio.run(go())
    assert all("\n" not in m and m.startswith("cannot listen on ") for m in got), got
    assert "a TCP port in 0..65535" in got[-1], got
    with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{taken_port}: address already in use"):
        DaemonMetrics(loaded_config().site, ["pcc"]).serve(("127.0.0.1", taken_port))
    with pytest.raises(ListenError, match=f"cannot listen on {NO_SUCH_HOST}:9108: no such host"):
        DaemonMetrics(loaded_config().site, ["pcc"]).serve((NO_SUCH_HOST, 9108))


def test_a_privileged_port_without_root_says_so() -> None:
    e = listen_error("0.0.0.0", 502, PermissionError(errno.EACCES, "Permission denied"))
    assert (
        str(e)
        == "cannot listen on 0.0.0.0:502: permission denied (a port below 1024 needs root or CAP_NET_BIND_SERVICE)"
    )
    assert str(listen_error("::1", 5020, OSError(errno.EADDRINUSE, "x"))).startswith("cannot listen on [::1]:5020: ")


def _unprivileged_port_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text())
    except (OSError, ValueError):
        return 1024


@pytest.mark.skipif(_unprivileged_port_start() <= 502, reason="this host lets anyone listen on port 502")
def test_dimmer_agent_on_port_502_without_root_exits_2_in_one_line() -> None:
    cmd = [sys.executable, "-m", "dimmer.cli", "agent", "--sim-gpus", "1", "--port", "502"]
    if os.geteuid() == 0:  # root without the capability to bind a port below 1024: what a non-root user has
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv (util-linux) to drop CAP_NET_BIND_SERVICE")
        cmd = [setpriv, "--bounding-set", "-net_bind_service", "--inh-caps", "-net_bind_service", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2, r.stderr
    assert one_line(r.stderr) == (
        "dimmer: cannot listen on 127.0.0.1:502: permission denied (a port below 1024 needs root or "
        "CAP_NET_BIND_SERVICE)"
    )
