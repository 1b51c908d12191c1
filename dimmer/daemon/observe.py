"""Snapshot -> Observation: every value from its device with its age; NaN (never zero) where nothing was measured.

A value's age runs from when its device's reading was taken, or, for a device with an update counter, from when the
counter last moved (a meter: from when its value last changed): a device answering with old values ages like one that
does not answer. Domain limits are the lower of the config and what the site device reports (held at their last
known value while it is out); a campus meter takes precedence over the site device for the PCC.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dimmer.daemon.config import LoadedConfig
from dimmer.daemon.handles import DeviceHandle, ReadingLike, value_array, value_num
from dimmer.observation import Observation


@dataclass(frozen=True)
class Snapshot:
    """The last good reading of every device, frozen at one instant (`t_mono_s`, the daemon's monotonic clock)."""

    t_mono_s: float
    t_s: float  # the controller's clock (monotonic since start, times the clock speed)
    readings: tuple[ReadingLike | None, ...]  # by device, in config order; None: never read
    fresh_t_s: tuple[float, ...]  # by device: when its values were last new (a stuck update_count ages them)


class ObservationBuilder:
    """Turns a snapshot into an Observation: values with their ages; NaN (never zero) where nothing was measured."""

    def __init__(self, loaded: LoadedConfig, handles: list[DeviceHandle], speed: float) -> None:
        self.site = loaded.site
        self.limit_w = loaded.limit_w
        self.stale_s = loaded.config.safety.stale_s
        self.handles = handles
        self.speed = speed
        self.last_pcc_limit_w = math.nan  # a limit is held at its last known value while the site device is out
        self.last_domain_limit_w = np.full(self.site.n_domains, np.nan)
        self.last_ramp_w_per_min = math.nan
        self.last_job_running = np.ones(self.site.n_jobs, dtype=bool)
        self.last_job_ended = np.zeros(self.site.n_jobs, dtype=bool)

    def build(self, snap: Snapshot) -> Observation:
        site, n_r, n_d = self.site, self.site.n_racks, self.site.n_domains
        rack_power = np.full(n_r, np.nan)
        rack_load = np.full(n_r, np.nan)
        rack_peak = np.full(n_r, np.nan)
        rack_age = np.full(n_r, np.inf)
        rack_cap = np.full(n_r, np.nan)
        rack_floor = np.full(n_r, np.nan)
        rack_soc = np.full(n_r, np.nan)
        rack_energized = np.ones(n_r, dtype=bool)
        domain_power = np.full(n_d, np.nan)
        domain_age = np.full(n_d, np.inf)
        thermal = np.full(n_d, np.nan)
        pcc_w, pcc_age = math.nan, math.inf
        freq = math.nan
        soc, bess_w, online = math.nan, math.nan, False
        have_pcc_meter = False
        for h, r, t_fresh in zip(self.handles, snap.readings, snap.fresh_t_s, strict=True):
            if r is None:
                continue
            age = max(snap.t_mono_s - t_fresh, 0.0) * self.speed
            v = r.values
            if h.kind == "racks":
                sl, n = h.racks, h.racks.stop - h.racks.start
                rack_power[sl] = value_array(v, "power_w", n)
                rack_load[sl] = value_array(v, "load_w", n)
                rack_peak[sl] = value_array(v, "load_peak_hw", n) * 100.0
                rack_age[sl] = age
                rack_cap[sl] = value_array(v, "cap_w", n)
                rack_floor[sl] = value_array(v, "floor_w", n)
                rack_soc[sl] = value_array(v, "bbu_soc_frac", n)
                en = value_array(v, "energized", n)
                rack_energized[sl] = ~(en < 0.5)  # unknown counts as energized
            elif h.kind == "site":
                dp = value_array(v, "domain_power_w", n_d)
                fresh_d = np.isfinite(dp) & ~np.isfinite(domain_power)  # meters (below) take precedence
                domain_power = np.where(fresh_d, dp, domain_power)
                domain_age = np.where(fresh_d, age, domain_age)
                lim = value_array(v, "domain_limit_w", n_d)
                self.last_domain_limit_w = np.where(np.isfinite(lim), lim, self.last_domain_limit_w)
                if age <= self.stale_s:  # (a site split over units: each fills its own domains)
                    tf = value_array(v, "domain_thermal_frac", n_d)
                    thermal = np.where(np.isfinite(tf), tf, thermal)
                    freq = value_num(v, "grid_freq_hz")
                pl = value_num(v, "pcc_limit_w")
                if math.isfinite(pl):
                    self.last_pcc_limit_w = pl
                rl = value_num(v, "ramp_limit_w_per_min")
                if math.isfinite(rl):
                    self.last_ramp_w_per_min = rl
                jr = value_array(v, "job_running", site.n_jobs)
                self.last_job_running = np.where(np.isfinite(jr), jr > 0.5, self.last_job_running)
                je = value_array(v, "job_ended", site.n_jobs)
                self.last_job_ended = np.where(np.isfinite(je), je > 0.5, self.last_job_ended)
            elif h.kind == "meter":
                p = value_num(v, "power_w")
                domain_power[h.domain] = p
                domain_age[h.domain] = age if math.isfinite(p) else math.inf
                if h.domain == 0:
                    pcc_w, pcc_age, have_pcc_meter = p, (age if math.isfinite(p) else math.inf), True
            elif h.kind == "battery" and age <= self.stale_s:
                soc = value_num(v, "soc_frac")
                bess_w = value_num(v, "power_w")
                on = value_num(v, "online")
                online = bool(on > 0.5) if math.isfinite(on) else math.isfinite(soc)
        if not have_pcc_meter and math.isfinite(domain_power[0]):
            pcc_w, pcc_age = float(domain_power[0]), float(domain_age[0])
        limit = np.fmin(self.limit_w, self.last_domain_limit_w)
        pcc_limit = float(np.fmin(self.limit_w[0], self.last_pcc_limit_w))
        ramp = float(np.fmin(site.ramp_limit_w_per_min, self.last_ramp_w_per_min))
        return Observation(
            t_s=snap.t_s,
            rack_power_w=rack_power,
            rack_load_w=rack_load,
            rack_age_s=rack_age,
            rack_cap_w=rack_cap,
            rack_floor_w=rack_floor,
            rack_bbu_soc_frac=rack_soc,
            rack_energized=rack_energized,
            domain_power_w=domain_power,
            domain_age_s=domain_age,
            domain_limit_w=limit,
            domain_thermal_frac=thermal,
            pcc_power_w=pcc_w,
            pcc_age_s=pcc_age,
            pcc_limit_w=pcc_limit,
            ramp_limit_w_per_min=ramp,
            grid_freq_hz=freq,
            bess_soc_frac=soc if online else math.nan,
            bess_power_w=bess_w,
            bess_online=online,
            job_running=self.last_job_running.copy(),
            job_ended=self.last_job_ended.copy(),
            rack_load_peak_w=rack_peak,
        )
