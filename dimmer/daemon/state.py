"""The controller's filter state on disk: saved atomically every N cycles and at exit, restored at start.

A restart (an upgrade, a crash, a reboot) should not forget what the controller had learned: the caps it holds, the
grid target it is ramping, the envelopes and low-pass filters. Losing them would raise every cap to rated at once
and restart the grid target from the current load. The state is a small explicit dict per controller class (no
pickle: a state file must never run code), checked against the site on restore.

`vet_state_file` is the one door a saved state comes in by: it restores the controller from a file that fits, or
leaves it untouched and says why in one line. A controller with no trusted state (no file, or one refused: corrupt,
truncated, empty, a directory, NaN or out-of-range caps, another site or controller, too old) must not start at
rated: the daemon puts it at the safe cap (`start_without_state`) and lets caps rise from there at the controller's
cap rise rate (safety.StartRamp).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dimmer.atomicfile import write_atomic
from dimmer.control import Controller
from dimmer.control.dimmer import DimmerController, DimmerParams
from dimmer.control.filters import LowPass, SwingLevel, Window
from dimmer.site import SiteModel

log = logging.getLogger("dimmer.state")

FORMAT = "dimmer-state-v1"

# A state file is a few arrays per rack and domain (tens of kB at 1,000 racks): anything far larger is not one, and
# reading it whole (a /dev/zero in its place) must not exhaust memory before it is refused.
MAX_STATE_BYTES = 64 * 2**20


class StateMismatch(ValueError):
    """The saved state does not fit this controller and site."""


def site_fingerprint(site: SiteModel) -> dict[str, Any]:
    """What a state must agree with: the shape of the site and its jobs, and the GPU."""
    return {
        "gpu": site.gpu.name,
        "n_racks": site.n_racks,
        "n_domains": site.n_domains,
        "jobs": list(site.job_name),
    }


# -- JSON-safe arrays: inf and NaN are not JSON, so every float goes through a string-free encoding -----------------


def _enc(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return {"shape": list(x.shape), "data": [_enc_f(v) for v in x.ravel().tolist()]}
    if isinstance(x, float):
        return _enc_f(x)
    return x


def _enc_f(v: float) -> float | str:
    return v if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))


def _dec_arr(obj: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
    if not isinstance(obj, dict) or "data" not in obj or "shape" not in obj:
        raise StateMismatch(f"{what}: not an array")
    if tuple(obj["shape"]) != shape:
        raise StateMismatch(f"{what}: shape {tuple(obj['shape'])}, expected {shape}")
    data = np.asarray([_dec_f(v, what) for v in obj["data"]], dtype=np.float64)
    if data.size != math.prod(shape):
        raise StateMismatch(f"{what}: {data.size} values, expected {math.prod(shape)}")
    return data.reshape(shape)


def _dec_f(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise StateMismatch(f"{what}: not a number")
    try:
        return float(v)
    except ValueError:
        raise StateMismatch(f"{what}: not a number") from None


def _dec_opt_f(v: Any, what: str) -> float | None:
    return None if v is None else _dec_f(v, what)


# -- DimmerController ------------------------------------------------------------------------------------------------


def _window_to(w: Window) -> dict[str, Any]:
    return {"buf": _enc(w._buf), "i": w._i}


def _window_from(w: Window, d: Any, what: str) -> None:
    if not isinstance(d, dict):
        raise StateMismatch(f"{what}: not a window")
    buf = _dec_arr(d.get("buf"), w._buf.shape, f"{what}.buf")
    i = d.get("i")
    if not isinstance(i, int) or not 0 <= i < w._buf.shape[0]:
        raise StateMismatch(f"{what}.i: out of range")
    w._buf[...] = buf
    w._i = i


def _lowpass_to(f: LowPass) -> Any:
    return None if f.value is None else _enc(np.asarray(f.value, dtype=np.float64))


def _lowpass_from(f: LowPass, d: Any, shape: tuple[int, ...], what: str) -> None:
    f.value = None if d is None else _dec_arr(d, shape, what)


def _level_from(f: SwingLevel, d: Any, what: str) -> None:
    if d is None:  # saved before the level filter: it learns afresh
        return
    if not isinstance(d, dict):
        raise StateMismatch(f"{what}: not a level filter")
    if "hist" not in d:  # saved before the window followed the readings' period (a buffer as long as the least
        return  # window): the level learns afresh, as at a first start, rather than refusing the rest
    buf = _dec_arr(d.get("buf"), f._buf.shape, f"{what}.buf")
    i, seen = d.get("i"), d.get("seen")
    if not isinstance(i, int) or not 0 <= i < f._buf.shape[0] or not isinstance(seen, int) or seen < 0:
        raise StateMismatch(f"{what}.i / seen: out of range")
    hist = _dec_arr(d.get("hist"), f._hist.shape, f"{what}.hist")
    if np.isinf(buf).any() or np.isinf(hist).any():  # (NaN is an empty slot; an infinite reading is no reading)
        raise StateMismatch(f"{what}: an infinite reading")
    f._hist[...] = hist
    f._buf[...] = buf
    f._i, f._seen = i, seen
    f.span = max(_dec_f(d.get("span", 0.0), f"{what}.span"), 0.0)


def dimmer_to_dict(c: DimmerController) -> dict[str, Any]:
    return {
        "cap_w": _enc(c.cap_w),
        "floor_w": _enc(c.floor_w),
        "grid_target_w": None if c.grid_target_w is None else _enc_f(c.grid_target_w),
        "ramp_history_w": _enc(c.ramp_room.history_w),
        "return_hold": {"spent_j": _enc_f(c.return_hold.spent_j), "released": c.return_hold.released},
        "rack_last_w": _enc(c.rack_last_w),
        "domain_env": _window_to(c.domain_env),
        "rack_env": _window_to(c.rack_env),
        "forecast": _lowpass_to(c.forecast),
        "bus_level": {
            "buf": _enc(c.bus_level._buf),
            "i": c.bus_level._i,
            "seen": c.bus_level._seen,
            "hist": _enc(c.bus_level._hist),
            "span": _enc_f(c.bus_level.span),
        },
        "bbu_allowance": _enc(c.bbus.allowance),
        "bbu_recharge_w": _enc(c.bbus.recharge_w),
        "bbu_given_w": _enc(c.bbus.given_w),
        "bbu_cycles": {
            "turn": _enc(c.bbus.cycles.turn),
            "extreme": _enc(c.bbus.cycles.extreme),
            "direction": _enc(c.bbus.cycles.direction.astype(np.float64)),
        },
        "recent_rise_w": _enc(c.recent_rise_w),
        "pcc_fit": _enc(c.pcc_check.sums),
    }


def dimmer_from_dict(c: DimmerController, d: dict[str, Any]) -> None:
    """Restore into `c`; StateMismatch (and `c` untouched) if any piece does not fit."""
    site = c.site
    # decode everything first, assign only when all of it fits
    cap = _dec_arr(d.get("cap_w"), (site.n_jobs,), "cap_w")
    floor = _dec_arr(d.get("floor_w"), (site.n_racks,), "floor_w")
    rack_last = _dec_arr(d.get("rack_last_w"), (site.n_racks,), "rack_last_w")
    grid = _dec_opt_f(d.get("grid_target_w"), "grid_target_w")
    if grid is not None and not math.isfinite(grid):
        raise StateMismatch("grid_target_w: not finite")
    # (absent from files saved before the ramp room: the import's history is learned afresh from the next reading)
    n_hist = c.ramp_room.history_w.shape
    ramp_hist = _dec_arr(d["ramp_history_w"], n_hist, "ramp_history_w") if "ramp_history_w" in d else None
    ramp_seen = 0 if ramp_hist is None else int(np.count_nonzero(np.isfinite(ramp_hist)))
    hold = d.get("return_hold", {"spent_j": 0.0, "released": False})
    if not isinstance(hold, dict) or not isinstance(hold.get("released"), bool):
        raise StateMismatch("return_hold: not a return hold")
    hold_spent = _dec_f(hold.get("spent_j"), "return_hold.spent_j")
    if not math.isfinite(hold_spent) or hold_spent < 0:
        raise StateMismatch("return_hold.spent_j: not finite and non-negative")
    if ramp_hist is not None and (
        np.any(np.isinf(ramp_hist)) or np.any(np.isnan(ramp_hist[ramp_hist.shape[0] - ramp_seen :]))
    ):
        raise StateMismatch("ramp_history_w: infinite, or an unknown reading after a known one")
    gpu = site.gpu
    if np.any(~np.isfinite(cap)) or np.any(cap < gpu.min_cap_w - 1e-6) or np.any(cap > gpu.rated_w + 1e-6):
        raise StateMismatch(f"cap_w: caps outside the {gpu.name} range {gpu.min_cap_w:g}-{gpu.rated_w:g} W")
    floor_max_w = gpu.floor_max_frac * gpu.rated_w
    if np.any(~np.isfinite(floor)) or np.any(floor < 0) or np.any(floor > floor_max_w + 1e-6):
        raise StateMismatch(f"floor_w: floors outside the {gpu.name} range 0-{floor_max_w:g} W")
    trial = DimmerController(site, c.p)  # scratch filters: a partial failure leaves `c` as it was
    _window_from(trial.domain_env, d.get("domain_env"), "domain_env")
    _window_from(trial.rack_env, d.get("rack_env"), "rack_env")
    _lowpass_from(trial.forecast, d.get("forecast"), (1,), "forecast")
    _level_from(trial.bus_level, d.get("bus_level"), "bus_level")
    # absent from files saved before the BBU policy: a fresh day's allowance, no recharge under way, no open run
    n = (site.n_racks,)
    if "bbu_allowance" in d:
        allowance = _dec_arr(d["bbu_allowance"], n, "bbu_allowance")
        if not np.all(np.isfinite(allowance)):
            raise StateMismatch("bbu_allowance: not finite")
        trial.bbus.allowance = np.minimum(allowance, trial.bbus.budget)
    if "bbu_recharge_w" in d:
        recharge = _dec_arr(d["bbu_recharge_w"], n, "bbu_recharge_w")
        if not np.all(np.isfinite(recharge)):
            raise StateMismatch("bbu_recharge_w: not finite")
        trial.bbus.recharge_w = np.clip(recharge, 0.0, trial.bbus.rated_recharge_w)
    # (the relief planned last period, which the SoC read next may not show yet: the wear allowance counts it)
    if "bbu_given_w" in d:
        given = _dec_arr(d["bbu_given_w"], n, "bbu_given_w")
        if not np.all(np.isfinite(given)) or np.any(given < 0):
            raise StateMismatch("bbu_given_w: not finite and non-negative")
        trial.bbus.given_w = given
    runs = d.get("bbu_cycles")
    if runs is not None:
        if not isinstance(runs, dict):
            raise StateMismatch("bbu_cycles: not a cycle counter")
        direction = _dec_arr(runs.get("direction"), n, "bbu_cycles.direction")
        if not np.all(np.isin(direction, (-1.0, 0.0, 1.0))):
            raise StateMismatch("bbu_cycles.direction: not -1, 0 or 1")
        trial.bbus.cycles.turn = _dec_arr(runs.get("turn"), n, "bbu_cycles.turn")
        trial.bbus.cycles.extreme = _dec_arr(runs.get("extreme"), n, "bbu_cycles.extreme")
        trial.bbus.cycles.direction = direction.astype(np.int8)
    # absent from files saved before the PCC check and the rise memory existed: those start fresh
    rises = c.recent_rise_w.shape
    recent_rise = _dec_arr(d["recent_rise_w"], rises, "recent_rise_w") if "recent_rise_w" in d else np.zeros(rises)
    # the learned meter overhead: without it a restart would learn afresh from whatever the meter says then
    pcc_fit = _dec_arr(d["pcc_fit"], c.pcc_check.sums.shape, "pcc_fit") if "pcc_fit" in d else None
    if not np.all(np.isfinite(recent_rise)) or (pcc_fit is not None and not np.all(np.isfinite(pcc_fit))):
        raise StateMismatch("recent_rise_w / pcc_fit: not finite")
    c.cap_w = cap
    c.floor_w = floor
    c.rack_last_w = rack_last
    c.grid_target_w = grid
    c.ramp_room.history_w = np.full(n_hist, np.nan) if ramp_hist is None else ramp_hist
    c.return_hold.spent_j, c.return_hold.released = hold_spent, hold["released"]
    c.domain_env, c.rack_env = trial.domain_env, trial.rack_env
    c.forecast, c.bus_level, c.bbus = trial.forecast, trial.bus_level, trial.bbus
    c.recent_rise_w = recent_rise
    if pcc_fit is not None:
        c.pcc_check.sums = pcc_fit
    c.t_last_s = None  # the old process's clock means nothing here: the first step uses the nominal period


# Controllers whose state is saved: class -> (to dict, from dict). The baselines keep little state worth a file.
_CODECS: dict[type, tuple[Callable[[Any], dict[str, Any]], Callable[[Any, dict[str, Any]], None]]] = {
    DimmerController: (dimmer_to_dict, dimmer_from_dict),
}


def supports_state(ctrl: Controller) -> bool:
    return type(ctrl) in _CODECS


def controller_state(ctrl: Controller, site: SiteModel, wall_time_s: float | None = None) -> dict[str, Any] | None:
    """The state document for `ctrl`, or None if its class keeps none."""
    codec = _CODECS.get(type(ctrl))
    if codec is None:
        return None
    return {
        "format": FORMAT,
        "controller": ctrl.name,
        "saved_at_unix_s": time.time() if wall_time_s is None else wall_time_s,
        "site": site_fingerprint(site),
        "state": codec[0](ctrl),
    }


def restore_state(
    ctrl: Controller, site: SiteModel, doc: dict[str, Any], max_age_s: float, now_unix_s: float | None = None
) -> None:
    """Load `doc` into `ctrl`; StateMismatch with the reason if it does not fit (ctrl is then unchanged)."""
    codec = _CODECS.get(type(ctrl))
    if codec is None:
        raise StateMismatch(f"controller {ctrl.name!r} keeps no state")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StateMismatch(f"not a {FORMAT} document")
    if doc.get("controller") != ctrl.name:
        raise StateMismatch(f"saved by controller {doc.get('controller')!r}, running {ctrl.name!r}")
    if doc.get("site") != site_fingerprint(site):
        raise StateMismatch("saved for a different site (racks, domains, jobs or GPU differ)")
    now = time.time() if now_unix_s is None else now_unix_s
    saved = doc.get("saved_at_unix_s")
    if not isinstance(saved, int | float) or not math.isfinite(saved):
        raise StateMismatch("no valid saved_at_unix_s")
    if not -60.0 <= now - saved <= max_age_s:
        raise StateMismatch(f"saved {now - saved:.0f} s ago, older than {max_age_s:g} s (or in the future)")
    state = doc.get("state")
    if not isinstance(state, dict):
        raise StateMismatch("no state table")
    codec[1](ctrl, state)


def save_state_file(path: Path, doc: dict[str, Any]) -> None:
    """Write `doc` to `path` atomically."""
    write_atomic(path, json.dumps(doc, separators=(",", ":"), allow_nan=False))


@dataclass(frozen=True)
class StateVerdict:
    """What `vet_state_file` decided: `restored`, or not and why (`why`, one line for the log and the audit);
    `refused` when something was there and was not used (False: restored, or nothing saved to restore)."""

    restored: bool
    refused: bool
    why: str


def vet_state_file(
    ctrl: Controller, site: SiteModel, path: Path | None, max_age_s: float, now_unix_s: float | None = None
) -> StateVerdict:
    """The one door a saved state comes in by. Restores `ctrl` from `path` only when the file is a readable
    `dimmer-state-v1` JSON document, at most MAX_STATE_BYTES, saved by this controller for this site (racks, domains,
    jobs, GPU) between 60 s in the future and `max_age_s` ago, every value finite where it must be, every cap within
    the GPU's settable range (min_cap_w-rated_w) and every floor within its floor range. Anything else leaves `ctrl`
    exactly as it was and the verdict says why. Logs nothing and never raises: whatever a file holds, the daemon
    starts (without trusted state, at the safe cap)."""
    if not supports_state(ctrl):
        return StateVerdict(False, False, f"controller {ctrl.name!r} keeps no state")
    if path is None:
        return StateVerdict(False, False, "no state_file configured")
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        return StateVerdict(False, False, f"no state file at {path}")
    except OSError as exc:  # a directory in its place, no permission, an I/O error
        return StateVerdict(False, True, f"state file {path} unreadable ({type(exc).__name__}: {exc.strerror or exc})")
    if len(raw) > MAX_STATE_BYTES:
        return StateVerdict(False, True, f"state file {path} over {MAX_STATE_BYTES} bytes: not a state file")
    if not raw.strip():
        return StateVerdict(False, True, f"state file {path} is empty")
    try:
        doc = json.loads(raw.decode("utf-8"))
        restore_state(ctrl, site, doc, max_age_s, now_unix_s)
    except UnicodeDecodeError:
        return StateVerdict(False, True, f"state file {path} is not UTF-8 text")
    except json.JSONDecodeError as exc:
        return StateVerdict(False, True, f"state file {path} is not JSON ({exc})")
    except StateMismatch as exc:
        return StateVerdict(False, True, f"state file {path} does not fit ({exc})")
    except Exception as exc:  # hostile content (deep nesting, a 400-digit number): refused, never a crash at start
        return StateVerdict(False, True, f"state file {path} is not a state ({type(exc).__name__}: {exc})")
    return StateVerdict(True, False, f"controller state restored from {path}")


def load_into(ctrl: Controller, site: SiteModel, path: Path, max_age_s: float) -> bool:
    """`vet_state_file`, logged: True when `ctrl` was restored, else a warning (info when there was no file)."""
    verdict = vet_state_file(ctrl, site, path, max_age_s)
    if verdict.restored:
        log.info("%s", verdict.why)
    elif verdict.refused:
        log.warning("%s: ignored, starting fresh", verdict.why)
    elif supports_state(ctrl):
        log.info("%s: starting fresh", verdict.why)
    return verdict.restored


def start_without_state(ctrl: Controller, safe_cap_w: float) -> float:
    """Put a controller that has no trusted state at the safe cap, so that its own caps rise from there within its
    own headroom and ramp room rather than from rated, and return the rate caps may rise at from there (W per GPU
    per second): the controller's `cap_rise_w_per_s`, or the dimmer default for a controller that has none (the
    baselines: the daemon's start ramp then paces them alone)."""
    parts = _dimmer_parts(ctrl)
    for part in parts:
        part.cap_w = np.minimum(part.cap_w, float(part.site.gpu.clamp_cap_w(safe_cap_w)))
    if parts:
        return float(parts[0].p.cap_rise_w_per_s)
    default = DimmerParams.model_fields["cap_rise_w_per_s"].default
    return float(getattr(getattr(ctrl, "p", None), "cap_rise_w_per_s", default))


def hold_caps_at_most(ctrl: Controller, cap_w: float) -> None:
    """Keep a controller's own caps at most `cap_w` (the start ramp's ceiling), so that what it believes it holds
    is what was written: a cut it decides is then cut from the cap in force, not from one the ramp never let out."""
    for part in _dimmer_parts(ctrl):
        part.cap_w = np.minimum(part.cap_w, cap_w)


def _dimmer_parts(ctrl: Controller) -> list[DimmerController]:
    """The dimmer controllers a controller runs: itself, or a hierarchy's (dimmer-campus: one per building)."""
    if isinstance(ctrl, DimmerController):
        return [ctrl]
    parts = getattr(ctrl, "dimmer_parts", None)
    return list(parts()) if callable(parts) else []


def save_from(ctrl: Controller, site: SiteModel, path: Path) -> bool:
    """Save `ctrl`'s state to `path`; log and return False on an I/O error (a full disk must not stop the loop)."""
    doc = controller_state(ctrl, site)
    if doc is None:
        return False
    try:
        save_state_file(path, doc)
    except OSError as exc:
        log.warning("could not save state to %s: %s", path, exc)
        return False
    return True
