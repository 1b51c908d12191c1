"""systemd: sd_notify (READY=1, STATUS=, WATCHDOG=1, STOPPING=1) without libsystemd, and the watchdog's interval.

Under a unit with `Type=notify` systemd passes `NOTIFY_SOCKET` (a datagram socket; "@..." is the abstract
namespace); with `WatchdogSec=` it also passes `WATCHDOG_USEC` (the interval, microseconds) and `WATCHDOG_PID` (the
process it is meant for: a child that inherited it is not). The daemon sends `WATCHDOG=1` after every cycle that
completed, never from a timer of its own (a loop stuck in a cycle must be seen as stuck), so its period has to fit
inside the interval with room to spare: `watchdog_error` says when it does not, and the daemon refuses to start.

The unit file shipped with the package is `dimmer/daemon/systemd/dimmer.service` (`unit_file_text()`).
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Mapping
from importlib import resources

from dimmer.daemon.config import LoadedConfig
from dimmer.errors import InputError

log = logging.getLogger("dimmer.daemon")

ENVIRONMENT = "environment"  # the source an error about a variable of the process's environment names
_UNSIGNED = re.compile(r"[0-9]+")


def watchdog_usec(environ: Mapping[str, str]) -> int | None:
    """The watchdog interval systemd asks this process to keep (microseconds), or None when there is none for it.

    `WATCHDOG_PID` set to another process: None (the watchdog is someone else's). `WATCHDOG_USEC` or
    `WATCHDOG_PID` that is not a positive integer: InputError (a unit or an environment that is wrong)."""
    pid_text = environ.get("WATCHDOG_PID")
    if pid_text is not None:
        if not _UNSIGNED.fullmatch(pid_text) or int(pid_text) <= 0:
            raise InputError(ENVIRONMENT, "WATCHDOG_PID", f"a process id (got {pid_text!r})")
        if int(pid_text) != os.getpid():
            return None
    text = environ.get("WATCHDOG_USEC")
    if text is None:
        return None
    if not _UNSIGNED.fullmatch(text) or int(text) <= 0:
        raise InputError(ENVIRONMENT, "WATCHDOG_USEC", f"a positive integer number of microseconds (got {text!r})")
    return int(text)


def watchdog_error(
    watchdog_s: float | None, loaded: LoadedConfig, speed: float, discovery_factor: float
) -> InputError | None:
    """Why `loaded`, run at clock x`speed`, cannot keep a `watchdog_s` systemd watchdog notifying it once a cycle;
    None when it can (or there is no watchdog). Two notifications are at most a period (the wait) and a cycle
    apart, so: its period must be below half the interval (a notification at least twice an interval in steady
    state), and a period plus its longest cycle must be below the interval. The longest is a first one: reads of up
    to `discovery_factor` read timeouts (they discover every device), then writes of up to one."""
    if watchdog_s is None:
        return None
    d = loaded.config.daemon
    timeout_s = d.read_timeout_in_force_s  # the daemon's clock
    at = f" at clock x{speed:g}" if speed != 1.0 else ""
    if not d.period_s / speed < 0.5 * watchdog_s:
        return InputError(
            loaded.source,
            "daemon.period_s",
            f"below half the systemd watchdog interval (WatchdogSec {watchdog_s:g} s{at}: below "
            f"{0.5 * watchdog_s * speed:g} s), the daemon notifying it once a period (got {d.period_s:g} s)",
        )
    if not (d.period_s + (discovery_factor + 1.0) * timeout_s) / speed < watchdog_s:
        default = ", half the period by default" if d.read_timeout_s is None else ""
        most = (watchdog_s * speed - d.period_s) / (discovery_factor + 1.0)
        return InputError(
            loaded.source,
            "daemon.read_timeout_s",
            f"below {most:.3g} s, so that a period and a first cycle (reads of up to {discovery_factor:g} read "
            f"timeouts, then writes of one) fit in the systemd watchdog interval (WatchdogSec {watchdog_s:g} s{at}) "
            f"(got {timeout_s:g} s{default})",
        )
    return None


class SystemdNotifier:
    """sd_notify without libsystemd: datagrams to $NOTIFY_SOCKET ("@..." is the abstract namespace). No-op if unset.

    `address` overrides NOTIFY_SOCKET; `environ` (default: the process's) is where NOTIFY_SOCKET, WATCHDOG_USEC and
    WATCHDOG_PID are read. A WATCHDOG_USEC or WATCHDOG_PID that is not a positive integer raises InputError."""

    def __init__(self, address: str | None = None, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET") if address is None else address
        self.address: str | None = None
        self._sock: socket.socket | None = None
        self.watchdog_usec = watchdog_usec(env)
        if addr:
            self.address = "\0" + addr[1:] if addr.startswith("@") else addr
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    @property
    def watchdog_s(self) -> float | None:
        """The watchdog interval in seconds; None when systemd watches no watchdog for this process."""
        return None if self.watchdog_usec is None else self.watchdog_usec / 1e6

    def notify(self, message: str) -> bool:
        if self._sock is None or self.address is None:
            return False
        try:
            self._sock.sendto(message.encode(), self.address)
        except OSError as exc:
            log.debug("sd_notify %s failed: %s", message, exc)
            return False
        return True

    def watchdog(self) -> bool:
        """WATCHDOG=1: a cycle has completed (call it from the cycle, never from a timer)."""
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def unit_file_text() -> str:
    """The systemd unit shipped with the package (dimmer/daemon/systemd/dimmer.service)."""
    return resources.files("dimmer.daemon").joinpath("systemd/dimmer.service").read_text(encoding="utf-8")
