"""The grid side: a single-area frequency model, a measured-frequency replay, and the metrics on grid import.

Frequency (Kundur, *Power System Stability and Control*, single-area load-frequency model; per unit on the
system base, Δf in pu of nominal):

    2H · dΔf/dt = ΔPm − ΔPL − D·Δf
    Tg · dPv/dt = −Δf/R − Pv            governor
    Tt · dPm/dt = Pv − Pm               turbine
    ΔPL = (load_w − load0_w) / system_base_w

Closed forms for a step ΔPL from rest: initial RoCoF = −ΔPL/(2H) pu/s; steady state Δf = −ΔPL/(D + 1/R) pu.
The linear system is discretised exactly for inputs held constant over a tick (zero-order hold):
Ad = expm(A·dt), Bd = ∫₀^dt expm(A·s) ds · B, both from one expm of the augmented matrix [[A, B], [0, 0]]·dt.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt
from pydantic import Field, model_validator
from scipy.linalg import expm
from scipy.signal import butter, sosfiltfilt

from dimmer.errors import InputError
from dimmer.siteconfig import Strict
from gridsim.plant.voltage import RideThroughSpec, SourceSpec

FloatArray = npt.NDArray[np.float64]


class FrequencySpec(Strict):
    """The synchronous area the campus sits in (textbook single-area model).

    Typical ranges (Kundur, MODELS.md): H 2-9 s, R 0.05, D 0.8-2 pu, Tg ≈ 0.2 s, Tt ≈ 0.5 s. The bounds
    below only reject nonsense; the validator also rejects parameter sets whose closed loop is unstable.
    """

    nominal_hz: float = Field(default=50.0, gt=0)
    # *assumption*: committed generation of the synchronous area the campus sits in (a what-if knob:
    # a 150 MW campus on a 10 GW base is 1.5 % of the system)
    system_base_mw: float = Field(default=10_000.0, gt=0)
    inertia_h_s: float = Field(default=5.0, gt=0, le=30)  # textbook 2-9 s
    droop_r_pu: float = Field(default=0.05, gt=0, le=1)  # 5 % droop
    damping_d_pu: float = Field(default=1.0, ge=0, le=10)  # textbook 0.8-2
    governor_tg_s: float = Field(default=0.2, gt=0, le=60)
    turbine_tt_s: float = Field(default=0.5, gt=0, le=60)
    # the voltage at the PCC (gridsim/plant/voltage.py): the Thevenin source and the ride-through asked of the site
    source: SourceSpec = SourceSpec()
    ride_through: RideThroughSpec = RideThroughSpec()

    @model_validator(mode="after")
    def _stable(self) -> FrequencySpec:
        a, _ = state_matrices(self)
        if float(np.max(np.linalg.eigvals(a).real)) >= 0.0:
            raise ValueError(
                "these H, R, D, Tg, Tt make the single-area frequency loop unstable "
                "(raise inertia_h_s or droop_r_pu, or shorten governor_tg_s / turbine_tt_s)"
            )
        return self


def state_matrices(spec: FrequencySpec) -> tuple[FloatArray, FloatArray]:
    """(A, B) of x' = A x + B ΔPL with x = (Δf, Pv, Pm) in pu."""
    two_h = 2.0 * spec.inertia_h_s
    tg, tt = spec.governor_tg_s, spec.turbine_tt_s
    a = np.array(
        [
            [-spec.damping_d_pu / two_h, 0.0, 1.0 / two_h],
            [-1.0 / (spec.droop_r_pu * tg), -1.0 / tg, 0.0],
            [0.0, 1.0 / tt, -1.0 / tt],
        ]
    )
    b = np.array([-1.0 / two_h, 0.0, 0.0])
    return a, b


def discretise(spec: FrequencySpec, dt_s: float) -> tuple[FloatArray, FloatArray]:
    """Exact zero-order-hold (Ad, Bd) for a step of `dt_s`."""
    a, b = state_matrices(spec)
    m = np.zeros((4, 4))
    m[:3, :3] = a * dt_s
    m[:3, 3] = b * dt_s
    e = expm(m)
    return e[:3, :3].copy(), e[:3, 3].copy()


def steady_state_dev_hz(spec: FrequencySpec, delta_load_w: float) -> float:
    """Closed form: the settled deviation after a load step, −ΔPL/(D + 1/R) pu, in Hz."""
    dpl = delta_load_w / (spec.system_base_mw * 1e6)
    return -dpl / (spec.damping_d_pu + 1.0 / spec.droop_r_pu) * spec.nominal_hz


def initial_rocof_hz_per_s(spec: FrequencySpec, delta_load_w: float) -> float:
    """Closed form: the RoCoF just after a load step from rest, −ΔPL/(2H) pu/s, in Hz/s."""
    dpl = delta_load_w / (spec.system_base_mw * 1e6)
    return -dpl / (2.0 * spec.inertia_h_s) * spec.nominal_hz


class FrequencyModel:
    """The area's frequency as the campus load moves it, stepped at a fixed `dt_s` (3x3 mat-vec a tick)."""

    def __init__(self, spec: FrequencySpec, load0_w: float, dt_s: float) -> None:
        if not dt_s > 0:
            raise ValueError("dt_s must be > 0")
        self.spec = spec
        self.dt_s = float(dt_s)
        self.nominal_hz = float(spec.nominal_hz)
        self.load0_w = float(load0_w)
        self._inv_base_w = 1.0 / (spec.system_base_mw * 1e6)
        ad, bd = discretise(spec, self.dt_s)
        self.ad: FloatArray = ad
        self.bd: FloatArray = bd
        # plain floats: a 3x3 mat-vec in Python arithmetic beats numpy's call overhead at this size
        (
            (self._a00, self._a01, self._a02),
            (self._a10, self._a11, self._a12),
            (self._a20, self._a21, self._a22),
        ) = ad.tolist()
        self._b0, self._b1, self._b2 = bd.tolist()
        self.reset()

    def reset(self, load0_w: float | None = None) -> None:
        """Back to rest (nominal frequency, governor and turbine at their set points)."""
        if load0_w is not None:
            self.load0_w = float(load0_w)
        self._x0 = self._x1 = self._x2 = 0.0
        self.model_dev_hz = 0.0  # the modelled part of the deviation
        self.dev_hz = 0.0  # modelled + replayed external deviation, as of the last step
        self.rocof_hz_per_s = 0.0  # (dev now − dev a step ago) / dt

    @property
    def state_pu(self) -> tuple[float, float, float]:
        """(Δf, Pv, Pm) in pu."""
        return self._x0, self._x1, self._x2

    @property
    def freq_hz(self) -> float:
        return self.nominal_hz + self.dev_hz

    def step(self, load_w: float, extra_dev_hz: float = 0.0) -> float:
        """Advance one tick with `load_w` held over it; returns the frequency in Hz at the end of the tick.

        `extra_dev_hz` is added on top of the modelled deviation (a replayed measured event, FrequencyReplay).
        """
        u = (float(load_w) - self.load0_w) * self._inv_base_w
        x0, x1, x2 = self._x0, self._x1, self._x2
        self._x0 = self._a00 * x0 + self._a01 * x1 + self._a02 * x2 + self._b0 * u
        self._x1 = self._a10 * x0 + self._a11 * x1 + self._a12 * x2 + self._b1 * u
        self._x2 = self._a20 * x0 + self._a21 * x1 + self._a22 * x2 + self._b2 * u
        self.model_dev_hz = self._x0 * self.nominal_hz
        dev = self.model_dev_hz + extra_dev_hz
        self.rocof_hz_per_s = (dev - self.dev_hz) / self.dt_s
        self.dev_hz = dev
        return self.nominal_hz + dev


# ---- measured frequency ---------------------------------------------------------------------------------
ReplayValues = Literal["frequency_hz", "deviation_mhz"]
# A record that strays this far from nominal is not a frequency record of this grid (a 60 Hz record in a 50 Hz
# scenario, Hz read as mHz or the reverse); under-frequency load shedding ends every real event well inside it.
PLAUSIBLE_FRAC = 0.1
# *assumption*: how fast the frequency leaves nominal before a record and returns after it. A deviation off nominal
# persists only while an imbalance holds it; the imbalance at a record's edge is unknown, and secondary control
# (GB secondary response: full within 30 s; ENTSO-E aFRR: full activation within 5 min) takes it away in minutes.
DEFAULT_SETTLE_TAU_S = 60.0


def _value_unit(name: str) -> ReplayValues | None:
    """The unit a header's value column names, if it names one ('deviation_mhz', 'f_mhz'; 'frequency_hz', 'f')."""
    n = name.strip().lower()
    if "mhz" in n:
        return "deviation_mhz"
    if n.endswith("hz") or n in ("f", "freq", "frequency"):
        return "frequency_hz"
    return None


def load_frequency_csv(
    path: str | Path,
    source: str,
    key: str,
    sample_s: float = 1.0,
    values: ReplayValues = "frequency_hz",
    nominal_hz: float = 50.0,
) -> tuple[FloatArray, FloatArray]:
    """Read a measured frequency record: (t_s, freq_hz), the absolute frequency in Hz at each sample.

    One sample a line, comma-separated: `index,value` (t = index x sample_s; the NESO files) or `value` alone (t =
    its place x sample_s). `values` is what the value is: "frequency_hz" (the frequency in Hz) or "deviation_mhz"
    (f - nominal in mHz, as several operators publish it). One header line is optional: a first line that is not
    a number, with the data's column count; when its value column names a unit (Hz or mHz) that unit must be
    `values`. CRLF or LF, a UTF-8 BOM, blank lines are fine. Every sample must lie within PLAUSIBLE_FRAC of
    nominal (a unit mix-up fails here, not as a 50 kHz grid); the index must increase; at least two samples.
    Every failure is an InputError naming `source`, `key`, the file, the line and what was expected (never what
    the line held: the path may point anywhere).
    """
    from dimmer.inputfile import MAX_DATA_BYTES, read_input_text

    if not (sample_s > 0 and math.isfinite(sample_s)):
        raise InputError(source, key, f"a sample period > 0 s for {path} (got {sample_s!r})")
    p = Path(path)
    text = read_input_text(p, source, key, "frequency record (CSV)", MAX_DATA_BYTES)
    unit = "a frequency in Hz" if values == "frequency_hz" else "a deviation from nominal in mHz"
    hint = 'values = "deviation_mhz"' if values == "frequency_hz" else 'values = "frequency_hz"'
    scale, offset = (1.0, 0.0) if values == "frequency_hz" else (1e-3, nominal_hz)
    lo_hz, hi_hz = nominal_hz * (1.0 - PLAUSIBLE_FRAC), nominal_hz * (1.0 + PLAUSIBLE_FRAC)
    n_cols = 0  # 1 (value) or 2 (index,value): the header's or the first row's, then every row's
    layout = ""
    seen_data = False
    idx: list[float] = []
    freq: list[float] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split(",")
        first = not seen_data and n_cols == 0
        if first:
            try:
                float(parts[0])
            except ValueError:  # a header line: column names
                if len(parts) not in (1, 2):
                    raise InputError(
                        source, key, f"{p} line {n}: a header of 1 or 2 columns ('index,{values}' or '{values}')"
                    ) from None
                named = _value_unit(parts[-1])
                if named is not None and named != values:
                    raise InputError(
                        source, key, f"{p} line {n}: a value column in {values} as the event says, or {hint}"
                    ) from None
                n_cols = len(parts)
                layout = f"index,{values}" if n_cols == 2 else values
                continue
        if n_cols == 0:
            n_cols = len(parts) if len(parts) in (1, 2) else 2
            layout = f"index,{values}" if n_cols == 2 else values
        seen_data = True
        try:
            if len(parts) != n_cols:
                raise ValueError
            nums = [float(x) for x in parts]
        except ValueError:
            what = "an index and " + unit if n_cols == 2 else unit
            raise InputError(
                source,
                key,
                f"{p} line {n}: {n_cols} comma-separated number{'s' if n_cols == 2 else ''}, '{layout}' ({what})",
            ) from None
        f = nums[-1] * scale + offset
        if not (math.isfinite(f) and lo_hz <= f <= hi_hz):
            raise InputError(
                source,
                key,
                f"{p} line {n}: {unit}, the frequency within {PLAUSIBLE_FRAC:.0%} of the "
                f"{nominal_hz:g} Hz nominal ({lo_hz:g}-{hi_hz:g} Hz); a file of the other kind needs {hint}",
            )
        i = nums[0] if n_cols == 2 else float(len(idx))
        if not math.isfinite(i):
            raise InputError(source, key, f"{p} line {n}: a finite index")
        if idx and i <= idx[-1]:
            raise InputError(source, key, f"{p} line {n}: an index above the previous sample's ({idx[-1]:g})")
        idx.append(i)
        freq.append(f)
    if len(idx) < 2:
        raise InputError(source, key, f"{p}: at least two samples (it has {len(idx)})")
    return np.asarray(idx) * sample_s, np.asarray(freq)


class FrequencyReplay:
    """A measured trajectory replayed as the area's frequency: dev(t) = f(t − start) − nominal, the record itself.

    Linear between samples. Outside the record the deviation relaxes to 0, first-order with `settle_tau_s`, from
    the record's first sample (before `start_s`, backwards in time) and from its last (after it ends):

        dev(t) = (f_first − nominal) · exp((t − start) / τ)      t < start
        dev(t) = (f_last − nominal) · exp(−(t − end) / τ)        t > end

    so the frequency is continuous at both edges (the record's own values, then no step of any size). Why not
    the area model's own recovery: a deviation persists only while an imbalance holds it, and the single-area model
    has primary response only; released at once, the imbalance holding the GB record's last 89 mHz would come back
    through the governors in under half a second (2H / (D + 1/R) ≈ 0.5 s at the defaults) at 0.19 Hz/s, a RoCoF
    above the event's own measured maximum (0.151 Hz/s). Secondary control takes an imbalance away over minutes,
    and the area follows it within its sub-second lag: what the first-order return is. τ is an assumption
    (DEFAULT_SETTLE_TAU_S).
    """

    def __init__(
        self,
        t_s: FloatArray,
        freq_hz: FloatArray,
        start_s: float,
        nominal_hz: float = 50.0,
        settle_tau_s: float = DEFAULT_SETTLE_TAU_S,
    ) -> None:
        t = np.asarray(t_s, dtype=np.float64)
        f = np.asarray(freq_hz, dtype=np.float64)
        if t.ndim != 1 or t.shape != f.shape or t.size < 2 or not bool(np.all(np.diff(t) > 0)):
            raise ValueError("t_s and freq_hz must be 1-D of equal length >= 2 with t_s increasing")
        if not (settle_tau_s > 0 and math.isfinite(settle_tau_s)):
            raise ValueError("settle_tau_s must be > 0 and finite")
        self.start_s = float(start_s)
        self.nominal_hz = float(nominal_hz)
        self.settle_tau_s = float(settle_tau_s)
        rel = t - t[0]
        dev = f - self.nominal_hz
        self._rel: FloatArray = rel
        self._dev: FloatArray = dev
        self._rel_list: list[float] = rel.tolist()
        self._dev_list: list[float] = dev.tolist()
        self.duration_s = float(rel[-1])

    def dev_hz(self, t_s: float) -> float:
        x = t_s - self.start_s
        rel, dev = self._rel_list, self._dev_list
        if x < 0.0:
            return dev[0] * math.exp(x / self.settle_tau_s)
        if x > self.duration_s:
            return dev[-1] * math.exp((self.duration_s - x) / self.settle_tau_s)
        i = bisect_right(rel, x) - 1
        if i >= len(rel) - 1:
            return dev[-1]
        t0 = rel[i]
        return dev[i] + (x - t0) / (rel[i + 1] - t0) * (dev[i + 1] - dev[i])

    def dev_hz_array(self, t_s: FloatArray) -> FloatArray:
        """dev_hz over an array of times (vectorised): the record held at its edges, times the relaxation."""
        x = np.asarray(t_s, dtype=np.float64) - self.start_s
        outside = np.minimum(x, 0.0) - np.maximum(x - self.duration_s, 0.0)  # <= 0: time beyond an edge, signed
        out: FloatArray = np.interp(x, self._rel, self._dev) * np.exp(outside / self.settle_tau_s)
        return out


# ---- metrics over recorded series -----------------------------------------------------------------------
# Violation tolerance: a sample counts only when it exceeds the limit by more than 1 ppm of the limit, so a
# controller holding exactly at a limit is not charged for floating-point rounding.
TOL_FRAC = 1e-6
BAND_FILTER_ORDER = 4  # Butterworth order of the band-pass; applied forward and backward (zero phase)
EDGE_PERIODS = 2.0  # band_rms_w extends the series by this many periods of the lower band edge at each end
# The demand's first seconds, reflected back in time, stand for its unknown history before the run: two of the
# slowest training iterations (0.3-5 s, MODELS.md), so a swing goes on as it was, and short, so an event after them
# is not copied into the past.
PRE_RUN_S = 10.0


def _lag(dt_s: float, window_s: float) -> int:
    if not (dt_s > 0 and window_s > 0):
        raise ValueError("dt_s and window_s must be > 0")
    return max(1, round(window_s / dt_s))


def pre_run_w(p_w: FloatArray, n: int, dt_s: float, reference_w: FloatArray | None = None) -> FloatArray:
    """The `n` samples the metrics take to have come before the run, oldest first.

    `reference_w` (the uncontrolled demand; default `p_w` itself) over its first PRE_RUN_S seconds, reflected back
    in time as often as needed (t = -k dt mirrors t = k dt), plus p - reference held at its first value: what the
    controller and the storage add stood where the first tick has it (the plant starts settled and hands-off).
    A step at the first action is then a step into the run, and a swing that starts at its peak is not a level.
    """
    p = np.asarray(p_w, dtype=np.float64)
    ref = p if reference_w is None else np.asarray(reference_w, dtype=np.float64)
    if ref.shape != p.shape:
        raise ValueError("reference_w must have the shape of p_w")
    if p.shape[0] == 0 or n <= 0:
        return np.zeros(max(n, 0))
    m = max(1, min(round(PRE_RUN_S / dt_s), p.shape[0]))
    if m == 1:
        before = np.full(n, ref[0])
    else:
        back = np.arange(n, 0, -1) % (2 * (m - 1))  # samples before t = 0, oldest first, folded into one period
        before = ref[np.where(back <= m - 1, back, 2 * (m - 1) - back)]
    out: FloatArray = before + (p[0] - ref[0])
    return out


def window_means_w(
    p_w: FloatArray, dt_s: float, window_s: float, reference_w: FloatArray | None = None, windows_before: int = 0
) -> FloatArray:
    """m(t): the trailing mean of `p_w` over window_s (rounded to whole samples) at every sample of the run, the
    run preceded by `pre_run_w`; with `windows_before` k, also at the k·n samples before it (those first)."""
    p = np.asarray(p_w, dtype=np.float64)
    n = _lag(dt_s, window_s)
    ext = np.concatenate([pre_run_w(p, (windows_before + 1) * n, dt_s, reference_w), p])
    csum = np.concatenate([[0.0], np.cumsum(ext - (p[0] if p.shape[0] else 0.0))])
    ends = np.arange(n + 1, ext.shape[0] + 1)  # csum index one past each window's last sample
    out: FloatArray = (csum[ends] - csum[ends - n]) / n + (p[0] if p.shape[0] else 0.0)
    return out  # windows ending at the k·n samples before the run, then at every tick


def ramp_w_per_min(p_w: FloatArray, dt_s: float, window_s: float, reference_w: FloatArray | None = None) -> FloatArray:
    """The utility's ramp: change of the window-average power from one window to the next, per minute.

    ramp(t) = (m(t) - m(t - W)) / W x 60 with m the trailing mean over W = round(window_s / dt_s) samples.
    Averaging over the window is what separates a ramp (a change of the level) from an oscillation around it,
    which the band RMS measures; a step of dP shows as a peak ramp of dP / W. Measured from the first tick, the
    windows reaching back before the run into `pre_run_w` (reference_w: the uncontrolled demand), so a step at the
    first action counts like a step anywhere else; from 2W on it depends on the run alone.
    """
    p = np.asarray(p_w, dtype=np.float64)
    n = _lag(dt_s, window_s)
    means = window_means_w(p, dt_s, window_s, reference_w, windows_before=1)  # (n + N,)
    out: FloatArray = (means[n:] - means[:-n]) * (60.0 / (n * dt_s)) if p.shape[0] else np.zeros(0)
    return out


def ramp_violation_s(
    p_w: FloatArray,
    dt_s: float,
    window_s: float,
    limit_w_per_min: float,
    tol_frac: float = TOL_FRAC,
    reference_w: FloatArray | None = None,
) -> float:
    """Seconds (samples x dt) with |ramp over the window| > limit x (1 + tol_frac) (`ramp_w_per_min`)."""
    if math.isinf(limit_w_per_min):
        return 0.0
    ramp = ramp_w_per_min(p_w, dt_s, window_s, reference_w)
    return float(np.count_nonzero(np.abs(ramp) > limit_w_per_min * (1.0 + tol_frac))) * dt_s


def overlimit_s(p_w: FloatArray, dt_s: float, limit_w: float | FloatArray, tol_frac: float = TOL_FRAC) -> float:
    """Seconds (samples x dt) with p > limit x (1 + tol_frac); `limit_w` a scalar or a series like `p_w`."""
    p = np.asarray(p_w, dtype=np.float64)
    lim = np.asarray(limit_w, dtype=np.float64)
    return float(np.count_nonzero(p > lim * (1.0 + tol_frac))) * dt_s


def effective_band_hz(dt_s: float, lo_hz: float = 0.1, hi_hz: float = 20.0) -> tuple[float, float]:
    """The band band_rms_w measures at this sampling: edges clipped to Nyquist (1 / (2 dt))."""
    nyq = 0.5 / dt_s
    return min(lo_hz, nyq), min(hi_hz, nyq)


def band_rms_w(
    p_w: FloatArray, dt_s: float, lo_hz: float = 0.1, hi_hz: float = 20.0, reference_w: FloatArray | None = None
) -> float:
    """RMS of `p_w` after a zero-phase Butterworth band-pass [lo_hz, hi_hz].

    Order 4, run forward and backward (sosfiltfilt): magnitude response squared, −6 dB at the edges. The
    series cannot hold anything above Nyquist (1 / (2 dt): 5 Hz at dt 0.1 s), so when hi_hz ≥ Nyquist the
    upper edge is dropped and the filter is a high-pass at lo_hz (everything the series can show above
    lo_hz). Every sample of the run is in the mean; the filter's edge transients decay in an extension of
    EDGE_PERIODS / lo_hz seconds (20 s at 0.1 Hz; 1/hi_hz periods for a low-pass) at each end: before the run
    `pre_run_w` (reference_w: the uncontrolled demand), so a step at the first action is a step into the run; after
    it the run's mirror image (a steady swing goes on without a jump).

    Returns 0.0 when the band cannot be measured: lo_hz at or above Nyquist, or a series shorter than one period
    of the lower edge (10 s at 0.1 Hz). 0.0 then means "not measurable", not "measured zero".
    """
    if dt_s > 0 and lo_hz >= 0.5 / dt_s:
        return 0.0  # the band lies above Nyquist (a sizing run's 60 s tick: effective_band_hz gives lo = hi = Nyquist)
    if not (dt_s > 0 and hi_hz > lo_hz >= 0):
        raise ValueError("need dt_s > 0 and 0 <= lo_hz < hi_hz")
    p = np.asarray(p_w, dtype=np.float64)
    fs = 1.0 / dt_s
    nyq = 0.5 * fs
    if lo_hz >= nyq or p.size == 0:
        return 0.0
    mean = p.mean()
    x = p - mean
    if lo_hz == 0.0 and hi_hz >= nyq:
        return float(np.sqrt(np.mean(np.square(x))))
    slow_hz = lo_hz if lo_hz > 0.0 else hi_hz
    edge = math.ceil(EDGE_PERIODS / (slow_hz * dt_s))
    period = math.ceil(1.0 / (slow_hz * dt_s))
    if lo_hz == 0.0:
        sos = butter(BAND_FILTER_ORDER, hi_hz, btype="lowpass", fs=fs, output="sos")
    elif hi_hz >= nyq:
        sos = butter(BAND_FILTER_ORDER, lo_hz, btype="highpass", fs=fs, output="sos")
    else:
        sos = butter(BAND_FILTER_ORDER, [lo_hz, hi_hz], btype="bandpass", fs=fs, output="sos")
    if p.size < period:
        return 0.0
    pad = min(edge, p.size - 1)
    before = pre_run_w(p, edge, dt_s, reference_w) - mean
    after = x[-2 : -pad - 2 : -1]  # the mirror image: a steady swing goes on without a jump
    y = sosfiltfilt(sos, np.concatenate([before, x, after]), padtype=None)[edge : edge + p.size]
    return float(np.sqrt(np.mean(np.square(y))))


def max_rocof_hz_per_s(f_hz: FloatArray, dt_s: float, window_s: float = 0.5) -> float:
    """Largest |f(t) − f(t − window)| / window (RoCoF relays measure over ~0.5 s); 0 for a too-short series.

    The window is rounded to whole samples, at least one (a 1 s series gives a 1 s window).
    """
    f = np.asarray(f_hz, dtype=np.float64)
    n = _lag(dt_s, window_s)
    if f.shape[0] <= n:
        return 0.0
    return float(np.max(np.abs(f[n:] - f[:-n]))) / (n * dt_s)


def max_freq_dev_hz(f_hz: FloatArray, nominal_hz: float) -> float:
    """Largest |f − nominal|; 0 for an empty series."""
    f = np.asarray(f_hz, dtype=np.float64)
    return float(np.max(np.abs(f - nominal_hz))) if f.size else 0.0
