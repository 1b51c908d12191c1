"""A cap write not yet acting is counted at the cap sent, one overdue is lost (cap_landing.CapLanding); and the
controller that plans on it, under caps that land 20 s late."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dimmer.control import make_controller
from dimmer.control.cap_landing import CapLanding
from gridsim.engine import run
from gridsim.metrics import summarize
from gridsim.scenario import load_scenario
from tests.test_dimmer_controller import _job_caps, _obs, _site

RATED_W = 1200.0


def _landing(n: int = 2, stated_s: float = 0.0, max_s: float = 60.0) -> CapLanding:
    return CapLanding(n, RATED_W, stated_s, max_s)


def test_an_in_band_write_lands_by_the_next_reading_and_teaches_a_one_period_delay() -> None:
    cl = _landing()
    cl.sent(0.0, np.array([800.0, RATED_W]), np.full(2, RATED_W))
    # (the lag's tail, 15 W of a 400 W step: what the GPUs enforce, landed)
    assert cl.in_flight(1.0, 1.0, np.array([815.0, RATED_W])).tolist() == [False, False]
    assert cl.delay_s(1.0) == 1.0
    assert not cl.pending.any()


def test_a_path_that_delays_every_write_keeps_them_in_flight_and_learns_the_delay() -> None:
    """Nothing lands for 40 s (caps through a BMC): once the writes have waited two periods (the readings' own lag,
    counted at the caps reported) they are in flight, not lost, and a later write is then in flight for the 40 s
    learned and half a period, lost after that."""
    cl = _landing()
    old = np.full(2, RATED_W)
    cl.sent(0.0, np.array([800.0, 900.0]), old)
    assert not cl.in_flight(1.0, 1.0, old).any()
    for t in range(2, 40):
        assert cl.in_flight(float(t), 1.0, old).all()
    assert not cl.in_flight(40.0, 1.0, np.array([800.0, 900.0])).any()
    assert cl.delay_s(40.0) == 40.0
    cl.sent(41.0, np.array([600.0, 700.0]), np.array([800.0, 900.0]))
    # rack 1's write lands 40 s on; rack 0's never does
    assert cl.in_flight(81.0, 1.0, np.array([800.0, 700.0])).tolist() == [True, False]
    assert cl.in_flight(82.0, 1.0, np.array([800.0, 700.0])).tolist() == [False, False]  # overdue: lost
    assert cl.pending[0]  # (still unlanded: it lands if it ever shows)


def test_where_writes_land_within_the_readings_lag_a_lost_one_counts_at_the_cap_reported() -> None:
    """A path whose writes land by the next reading (in band): a write not landed is not in flight while writes
    land beside it (a row whose writes are lost counts at the caps its GPUs report, at once)."""
    cl = _landing(3)
    cl.sent(0.0, np.array([700.0, 700.0, 700.0]), np.full(3, RATED_W))
    reported = np.array([RATED_W, 700.0, 700.0])  # rack 0's write lost; the others landed at once
    for t in (1.0, 2.0, 3.0, 30.0):
        assert cl.in_flight(t, 1.0, reported).tolist() == [False, False, False]
    assert cl.delay_s(30.0) == pytest.approx(1.0, rel=0.01)


def test_a_stated_delay_keeps_writes_in_flight_that_long_whatever_lands_elsewhere() -> None:
    cl = _landing(2, stated_s=30.0)
    cl.sent(0.0, np.array([700.0, 700.0]), np.full(2, RATED_W))
    reported = np.array([RATED_W, 700.0])
    assert cl.in_flight(1.0, 1.0, reported).tolist() == [True, False]  # (rack 1's landed at once)
    assert cl.in_flight(30.0, 1.0, reported).tolist() == [True, False]
    assert cl.in_flight(31.0, 1.0, reported).tolist() == [False, False]


def test_a_long_delay_is_forgotten_slowly_and_a_shorter_one_then_believed() -> None:
    cl = CapLanding(1, RATED_W, 0.0, 60.0, forget_s=100.0)  # (an hour by default)
    cl.sent(0.0, np.array([700.0]), np.array([RATED_W]))
    cl.in_flight(40.0, 1.0, np.array([700.0]))
    assert cl.delay_s(40.0) == 40.0
    assert 40.0 * np.exp(-1.0) - 1e-9 <= cl.delay_s(140.0) < 40.0
    cl.sent(1000.0, np.array([800.0]), np.array([700.0]))
    cl.in_flight(1001.0, 1.0, np.array([800.0]))
    assert cl.delay_s(1001.0) == 1.0


def test_an_unread_cap_is_never_in_flight() -> None:
    cl = _landing()
    cl.sent(0.0, np.array([700.0, 700.0]), np.full(2, RATED_W))
    assert cl.in_flight(2.5, 1.0, np.array([np.nan, RATED_W])).tolist() == [False, True]


@given(
    sends=st.lists(st.tuples(st.floats(200.0, RATED_W), st.floats(200.0, RATED_W)), min_size=1, max_size=30),
    lag=st.integers(0, 80),
    max_s=st.floats(0.0, 60.0),
)
def test_a_write_is_in_flight_only_while_unlanded_and_never_past_its_bound(
    sends: list[tuple[float, float]], lag: int, max_s: float
) -> None:
    """Whatever is sent and however late it shows: a rack in flight has a write sent that its reported cap has not
    reached, no older than the longer of max_s and the delay learned and half a period."""
    cl = _landing(2, max_s=max_s)
    history = [np.full(2, RATED_W)]
    for k, caps in enumerate(sends, start=1):
        reported = history[max(len(history) - 1 - lag, 0)]
        flight = cl.in_flight(float(k), 1.0, reported)
        age = k - cl.sent_at_s
        bound = max(max_s, cl.delay_s(float(k)) + 0.5)
        assert not np.any(flight & (np.abs(reported - cl.sent_w) <= cl.tol_w))
        assert np.all(age[flight] <= bound)
        cl.sent(float(k), np.array(caps), reported)
        history.append(cl.sent_w.copy())


def _curtailed_with_caps_late(params: dict[str, float], lag: int = 20) -> tuple[list[dict[str, float]], list[float]]:
    """A campus over a 0.85 MW limit (no battery) whose caps reach the GPUs `lag` periods after they are sent;
    each period's job caps, and the campus's load."""
    site = _site(row_kw=600.0)
    ctrl = make_controller("dimmer", site, params)
    sent: list[np.ndarray] = []
    reported = np.full(site.n_racks, site.gpu.rated_w)
    caps, load = [], []
    for k in range(1, 70):
        if len(sent) >= lag:
            reported = sent[-lag]
        draw = np.minimum(1260.0, reported)
        load.append(float(site.domain_load_w(site.rack_power_w(draw))[0]))
        act = ctrl.step(_obs(site, float(k), draw, rack_cap_w=reported.copy(), pcc_limit_w=0.85e6))
        sent.append(act.rack_cap_w.copy())
        caps.append(_job_caps(site, act.rack_cap_w))
    return caps, load


def test_a_cut_whose_caps_land_late_is_not_made_again_every_period_until_it_shows() -> None:
    """Caps 20 s late: the first cut is made again once (its writes count at the caps reported while they have
    waited less than two periods, the readings' own lag), then the writes on their way are in flight, so the readings
    that still show the campus over its limit draw no more cuts, and once they land the campus is under the limit.
    Counted as lost after a period instead (cap_landing_max_s = 0), every job was cut again and again, to 200 W, and
    what landed swung the campus by 560 kW."""
    caps, load = _curtailed_with_caps_late({})
    assert load[0] > 0.85e6 and max(load[22:]) <= 0.97 * 0.85e6  # (the cuts show from the 21st and 22nd readings)
    second = caps[1]
    assert second["rl"] < 1400.0 or second["eval"] < 1400.0  # the campus was cut at once
    for c in caps[2:]:
        assert all(c[j] >= second[j] - 1e-6 for j in second)  # and no deeper after the second period
    assert min(load[22:]) > 0.6e6
    lost, lost_load = _curtailed_with_caps_late({"cap_landing_max_s": 0.0})
    assert min(c["pretrain"] for c in lost) < 300.0 and min(lost_load[22:]) < 0.45e6


def test_an_older_write_landing_on_the_way_is_not_the_latest_landing() -> None:
    """Out of band, a cut written each period lands 40 s on, one after another: the first landing moves the reported
    cap toward the latest write, which is still in flight (counted at its own cap, not at the older one)."""
    cl = _landing(1)
    reported = np.array([RATED_W])
    cl.sent(0.0, np.array([1100.0]), reported)
    cl.sent(1.0, np.array([800.0]), reported)
    assert cl.in_flight(40.0, 1.0, np.array([1100.0])).tolist() == [True]
    assert cl.delay_s(40.0) == 0.0  # (nothing landed: nothing learned)
    assert cl.in_flight(41.0, 1.0, np.array([800.0])).tolist() == [False]
    assert cl.delay_s(41.0) == 40.0


def test_a_fast_path_that_stops_landing_is_taken_for_a_slow_one_once_its_writes_have_waited_two_periods() -> None:
    """Every command late from some time on (fault commands-delayed): writes that land at once teach a fast path, and
    the first writes after the slowdown count at the caps reported until the first of them has waited two periods
    with nothing landing; then every write on its way is in flight, the newest too."""
    cl = _landing(2)
    cl.sent(0.0, np.array([900.0, 900.0]), np.full(2, RATED_W))
    assert not cl.in_flight(1.0, 1.0, np.array([900.0, 900.0])).any()  # landed: a one-period path
    cl.sent(10.0, np.array([800.0, 900.0]), np.array([900.0, 900.0]))
    assert not cl.in_flight(11.0, 1.0, np.array([900.0, 900.0])).any()
    cl.sent(11.0, np.array([800.0, 700.0]), np.array([900.0, 900.0]))
    assert cl.in_flight(12.0, 1.0, np.array([900.0, 900.0])).tolist() == [True, True]


def test_no_rise_is_granted_on_room_that_only_cuts_still_on_their_way_make() -> None:
    """oob-start-curtail: caps 15 s late, a curtailment falling 1.4 MW in 90 s, a job starting 30 s into it, a 0.5 MW
    battery. Counted at the caps sent, the cuts on their way made room the readings did not have; given to the
    starting job at once (and again each period, as its rises did not show either), its rise landed with the cuts
    and the campus went 6.4 s over the curtailed limit, by up to 518 kW."""
    path = Path(__file__).resolve().parents[1] / "scenarios" / "sites" / "oob-start-curtail.toml"
    s = summarize(run(load_scenario(path, ["duration_s=450"]), "dimmer"))
    assert s["breaker_trips"] == 0
    assert s["pcc_overlimit_s"] == 0.0
    assert s["goodput_loss_power_pct"] < 9.0  # (7.3 % over these 450 s; 9.5 % with every job cut to 200 W)


def test_before_any_write_has_landed_an_out_of_band_site_takes_its_writes_to_need_the_prior() -> None:
    """Caps through a BMC: until a write is seen landing, one is taken to need `prior_s` (in flight from the first
    period, not after two); the first landing's delay then replaces it, shorter or longer."""
    cl = CapLanding(2, RATED_W, 0.0, 60.0, prior_s=40.0)
    assert cl.delay_s(0.0) == 40.0
    cl.sent(0.0, np.array([800.0, 900.0]), np.full(2, RATED_W))
    assert cl.in_flight(1.0, 1.0, np.full(2, RATED_W)).all()
    assert not cl.in_flight(15.0, 1.0, np.array([800.0, 900.0])).any()
    assert cl.delay_s(15.0) == 15.0
    inband = CapLanding(2, RATED_W, 0.0, 60.0)
    inband.sent(0.0, np.array([800.0, 900.0]), np.full(2, RATED_W))
    assert not inband.in_flight(1.0, 1.0, np.full(2, RATED_W)).any()  # (the readings' own lag, as before)


def test_a_curtailment_under_out_of_band_caps_is_met_before_any_write_has_landed() -> None:
    """oob-curtail with half its battery (1 MW / 0.5 MWh), caps 40 s late, the limit falling 3.5 MW over two
    minutes: the first cut goes out before any write has landed. Planned on the readings' lag alone, it went out
    when the battery could no longer cover the fall and landed 40 s later: 5.2 s over the curtailed limit. With the
    site's cap path known (out of band) the caps lead the fall by what a BMC write needs, less what the battery can
    still give."""
    path = Path(__file__).resolve().parents[1] / "scenarios" / "sites" / "oob-curtail.toml"
    half = ["duration_s=600", "site.storage.bess.power_mw=1.0", "site.storage.bess.energy_mwh=0.5"]
    loaded = load_scenario(path, half)
    assert loaded.site().cap_path == "oob"
    s = summarize(run(loaded, "dimmer"))
    assert s["breaker_trips"] == 0
    assert s["pcc_overlimit_s"] == 0.0
    assert s["ramp_violation_s"] == 0.0
    assert s["goodput_loss_power_pct"] < 3.0  # (1.5 %; 19 % where each period's cut was made again until it showed)


def test_a_job_start_under_out_of_band_caps_breaks_the_ramp_rule_no_more_than_the_uncontrolled_site() -> None:
    """no-battery-start with its caps 20 s late (out of band): the 3.4 MW start arrives before any cap can, and the
    cut it draws lands 20 s later. The rises still on their way were not in the level the ramp rule's room was
    planned on, nor the cuts on their way in the room to fall, and the room that would pay the broken windows back
    asked for -38 MW of a 5 MW campus: every job at the lowest cap for minutes, 110 s over the rule in 420 s against
    the uncontrolled site's 68 s. Now 30 s."""
    path = Path(__file__).resolve().parents[1] / "scenarios" / "sites" / "no-battery-start.toml"
    oob = ["gpu.path=oob", "gpu.oob_delay_s=20", "duration_s=420"]
    dimmer = summarize(run(load_scenario(path, oob), "dimmer"))
    none = summarize(run(load_scenario(path, oob), "none"))
    assert dimmer["breaker_trips"] == 0 and dimmer["pcc_overlimit_s"] == 0.0
    assert dimmer["ramp_violation_s"] <= none["ramp_violation_s"]
