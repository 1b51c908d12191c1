"""The project's own devices in the served plant: the site device (dimmer-site-v1) and the rack devices
(dimmer-rack-v1, 64 racks each in tree order), with the rack devices' leases and their fallback.

A rack device's write is applied at the next control period. Never written: hands-off. Lease held (a write
within `lease_s` plant seconds): the written commands. Lease expired: caps at `safe_cap_w` (`fallback_cap_w`) and
floors 0 at once; the BBUs keep their last commands until the fallback cap has taken hold (`cap_settle_s`), then go
backup only, recharging at their rating. Releasing the BBUs together with the cap would let the swing's peaks
and the recharge reach the grid while the GPUs still draw the old cap (was 0.1 s over the interconnect limit).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import numpy.typing as npt

from dimmer.control.building_split import BUILDING_LEVEL
from dimmer.daemon import registers as R
from dimmer.daemon.config import uniform_cap_bound_w
from dimmer.observation import Actions, Observation
from dimmer.site import SiteModel
from gridsim.scenario import Scenario
from gridsim.serve.common import FIRST_RACK_UNIT, SITE_UNIT, Image

FloatArray = npt.NDArray[np.float64]
LEASE_AT = R.RACK_HEADER.field("lease_s").offset


def fallback_cap_w(site: SiteModel) -> float:
    """The highest per-GPU cap at which every domain stays within its rating — every breaker, and the interconnect
    limit at the campus — with every rack drawing its cap and every BBU recharging.

    This is what a rack device falls back to when its lease runs out: then nobody controls the plant, the campus
    battery has reverted to idle and the racks' BBUs are backup only, recharging uncoordinated, so the caps alone
    must hold every limit. Rack AC power is affine in the per-GPU draw, so each domain gives one bound (the racks'
    fixed load — idle spare GPUs, host overhead — and their BBU recharge come off its rating). Clipped to the GPU's
    settable range: a site whose load at the lowest cap exceeds a limit gets the lowest cap.
    """
    rs = site.rack_storage
    recharge_w = np.where(rs.bbu_energy_j > 0, rs.bbu_recharge_w, 0.0)
    bound = uniform_cap_bound_w(site, site.domain_rating_w, recharge_w)
    return float(np.clip(np.min(bound), site.gpu.min_cap_w, site.gpu.rated_w))


def cap_settle_s(scenario: Scenario) -> float:
    """How long after a rack device sets a cap the GPUs draw it: the actuation latency, then the out-of-band
    path's delay or seven time constants of the in-band lag (within 0.1 % of the step)."""
    gpu = scenario.gpu
    lag_s = gpu.oob_delay_s if gpu.path == "oob" else 7.0 * gpu.tau_s
    return float(scenario.engine.actuation_latency_s + lag_s)


def site_parts(site: SiteModel) -> list[tuple[int, int]]:
    """(first domain, domains) of each unit the site device is served on: a site of more domains than one unit's
    registers hold (dimmer-site-v1: 10,874) is split in runs of consecutive domains, a unit each (3, 4, ...)."""
    step = R.SITE_MAX_DOMAINS
    return [(a, min(step, site.n_domains - a)) for a in range(0, max(site.n_domains, 1), step)]


def site_image(site: SiteModel, first: int = 0, n: int | None = None, unit: int = SITE_UNIT) -> Image:
    """A site device unit's registers before the first observation: header, jobs and domains not implemented."""
    nd, nj = (site.n_domains - first) if n is None else n, site.n_jobs
    words = np.zeros(R.SITE_DOMAIN_BASE + R.SITE_DOMAIN_STRIDE * nd, dtype=np.int64)
    hdr = R.encode_block(
        R.SITE_HEADER,
        {"magic": R.SITE_MAGIC, "version": R.SITE_VERSION, "n_domains": nd, "n_jobs": nj, "update_count": 0,
         "first_domain": first},
    )  # fmt: skip
    words[: len(hdr)] = hdr
    words[R.SITE_JOB_BASE : R.SITE_JOB_BASE + R.SITE_MAX_JOBS] = R.U16_NA
    words[R.SITE_DOMAIN_BASE :] = R.encode_records(R.SITE_DOMAIN, {}, nd, R.SITE_DOMAIN_STRIDE)
    return Image(unit, 0, words.tolist(), np.zeros(words.shape[0], dtype=bool))


def publish_site(img: Image, site: SiteModel, obs: Observation, update_count: int, first: int = 0) -> None:
    if img.stalled:
        return
    img.set(6, R.encode_uint32(update_count))
    img.set(8, R.encode_float32([obs.pcc_limit_w, obs.ramp_limit_w_per_min, obs.grid_freq_hz]))
    if site.n_jobs:
        state = np.where(obs.job_running, R.JOB_RUNNING, R.JOB_STOPPED)
        if obs.job_ended is not None:
            state = np.where(obs.job_ended & ~obs.job_running, R.JOB_ENDED, state)
        img.set(R.SITE_JOB_BASE, state.astype(np.int64))
    n = (img.size - R.SITE_DOMAIN_BASE) // R.SITE_DOMAIN_STRIDE
    sl = slice(first, first + n)
    domains = {
        "power_w": obs.domain_power_w[sl],
        "limit_w": obs.domain_limit_w[sl],
        "thermal_frac": obs.domain_thermal_frac[sl],
    }
    img.set(R.SITE_DOMAIN_BASE, R.encode_records(R.SITE_DOMAIN, domains, n, R.SITE_DOMAIN_STRIDE))


def rack_device_spans(site: SiteModel) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(first rack, racks) of every rack device: 64 racks each in tree order, never across a building's edge (each
    building daemon of a campus writes its own racks' devices, and a device written by two would be fought over)."""
    d = np.flatnonzero(site.domain_level == BUILDING_LEVEL)
    edges = np.unique(np.concatenate(([0, site.n_racks], site.domain_rack_start[d], site.domain_rack_stop[d])))
    if edges.size < 2:  # a site of no racks: one empty device, as before
        return np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    first = np.concatenate([np.arange(a, b, R.RACK_MAX) for a, b in itertools.pairwise(edges)])
    stop = edges[np.searchsorted(edges, first, side="right")]
    return first.astype(np.int64), np.minimum(R.RACK_MAX, stop - first).astype(np.int64)


class RackDevices:
    """Every rack device of a site: their images, what their racks were told, and their leases (plant seconds)."""

    def __init__(self, site: SiteModel, safe_cap_w: float, cap_settle_s: float = 0.0) -> None:
        self.site = site
        self.safe_cap_w = safe_cap_w
        self.cap_settle_s = cap_settle_s
        self.first, self.count = rack_device_spans(site)
        self.n_devices = int(self.first.size)
        self.device_of_rack = np.repeat(np.arange(self.n_devices), self.count)
        # what the racks are told, decoded at write time
        self.hands = hands = Actions.hands_off(site)
        self.cmd_cap_w = hands.rack_cap_w.copy()
        self.cmd_floor_w = hands.rack_floor_w.copy()
        self.cmd_bbu_threshold_w = hands.rack_bbu_threshold_w.copy()
        self.cmd_bbu_recharge_w = hands.rack_bbu_recharge_w.copy()
        self.written = np.zeros(self.n_devices, dtype=bool)
        self.last_write_s = np.full(self.n_devices, -math.inf)
        self.lease_s = np.zeros(self.n_devices)
        self.expired = np.zeros(self.n_devices, dtype=bool)
        self.bbu_released = np.zeros(self.n_devices, dtype=bool)  # expired for longer than cap_settle_s
        self.lease_expiries = 0
        self.images = [self._image(k) for k in range(self.n_devices)]

    def _image(self, k: int) -> Image:
        nr, first = int(self.count[k]), int(self.first[k])
        words = np.zeros(R.rack_status_address(nr), dtype=np.int64)
        hdr = R.encode_block(
            R.RACK_HEADER,
            {
                "magic": R.RACK_MAGIC,
                "version": R.RACK_VERSION,
                "n_racks": nr,
                "first_rack": first,
                "safe_cap_w": self.safe_cap_w,
                "lease_state": R.LEASE_NONE,
                "update_count": 0,
                "lease_s": math.nan,
                "heartbeat": 0,
            },
        )
        words[: len(hdr)] = hdr
        sl = slice(first, first + nr)
        cmds = {
            "cap_w": self.cmd_cap_w[sl],
            "floor_w": self.cmd_floor_w[sl],
            "bbu_threshold_w": self.cmd_bbu_threshold_w[sl],
            "bbu_recharge_w": self.cmd_bbu_recharge_w[sl],
        }
        cmd = R.encode_records(R.RACK_COMMAND, cmds, nr, R.RACK_CMD_STRIDE)
        words[R.RACK_CMD_BASE : R.RACK_CMD_BASE + len(cmd)] = cmd
        words[R.RACK_STATUS_BASE :] = R.encode_records(R.RACK_STATUS, {}, nr, R.RACK_STATUS_STRIDE)
        writable = np.zeros(words.shape[0], dtype=bool)
        writable[LEASE_AT : R.rack_cmd_address(nr)] = True
        return Image(FIRST_RACK_UNIT + k, 0, words.tolist(), writable)

    def write(self, k: int, address: int, words: list[int], t_plant: float) -> int | None:
        """Vet a write to rack device `k` (inside its writable registers) and apply it; the exception code if
        refused (nothing applied then)."""
        img = self.images[k]
        n = len(words)
        cand = img.words.copy()
        cand[address - img.start : address - img.start + n] = words
        nr, first = int(self.count[k]), int(self.first[k])
        # the map's one vetting path, as `dimmer agent` answers: every value whole, in its declared range, no NaN
        # (+inf only for the BBU threshold: backup only), a lease of more than 0 s up to 86,400
        refused = R.rack_write_error(cand, address - img.start, n, nr)
        if refused is not None:
            return refused[0]
        lease_s = float(R.decode_float32(cand[LEASE_AT : LEASE_AT + 2])[0])
        recs = R.decode_records(R.RACK_COMMAND, cand[R.RACK_CMD_BASE : R.rack_cmd_address(nr)], nr, R.RACK_CMD_STRIDE)
        img.words[:] = cand
        sl = slice(first, first + nr)
        self.cmd_cap_w[sl] = recs["cap_w"]
        self.cmd_floor_w[sl] = recs["floor_w"]
        self.cmd_bbu_threshold_w[sl] = recs["bbu_threshold_w"]
        self.cmd_bbu_recharge_w[sl] = recs["bbu_recharge_w"]
        self.written[k] = True
        self.last_write_s[k] = t_plant
        self.lease_s[k] = lease_s if math.isfinite(lease_s) else 0.0
        return None

    def update_leases(self, t_s: float) -> None:
        """Which leases have run out at plant time `t_s` (counted once each time one runs out)."""
        held = self.written & (t_s - self.last_write_s <= self.lease_s)
        expired = self.written & ~held
        self.lease_expiries += int(np.count_nonzero(expired & ~self.expired))
        self.expired = expired
        self.bbu_released = expired & (t_s - self.last_write_s > self.lease_s + self.cap_settle_s)

    def commands(self) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
        """Per rack: cap, floor, BBU threshold, BBU recharge in force (a rack never written: hands-off)."""
        exp_r = self.expired[self.device_of_rack]
        rel_r = self.bbu_released[self.device_of_rack]
        return (
            np.where(exp_r, self.safe_cap_w, self.cmd_cap_w),
            np.where(exp_r, 0.0, self.cmd_floor_w),
            np.where(rel_r, np.inf, self.cmd_bbu_threshold_w),
            np.where(rel_r, self.hands.rack_bbu_recharge_w, self.cmd_bbu_recharge_w),
        )

    def publish(self, obs: Observation, update_count: int) -> None:
        site = self.site
        fields = {
            "power_w": obs.rack_power_w,
            "load_w": obs.rack_load_w,
            "cap_w": obs.rack_cap_w,
            "floor_w": obs.rack_floor_w,
            "bbu_soc_frac": obs.rack_bbu_soc_frac,
            "energized": obs.rack_energized.astype(np.float64),
        }
        if obs.rack_load_peak_w is not None:  # (rounded up: a peak is never reported under what was drawn)
            fields["load_peak_hw"] = np.ceil(obs.rack_load_peak_w / 100.0)
        status = np.asarray(
            R.encode_records(R.RACK_STATUS, fields, site.n_racks, R.RACK_STATUS_STRIDE), dtype=np.int64
        ).reshape(site.n_racks, R.RACK_STATUS_STRIDE)
        uc_words = R.encode_uint32(update_count)
        for k, img in enumerate(self.images):  # one slice copy per device (<= 64 racks each)
            state = R.LEASE_EXPIRED if self.expired[k] else (R.LEASE_HELD if self.written[k] else R.LEASE_NONE)
            img.set(8, [state])
            if img.stalled:
                continue
            first, nr = int(self.first[k]), int(self.count[k])
            img.set(10, uc_words)
            img.set(R.RACK_STATUS_BASE, status[first : first + nr].reshape(-1))
