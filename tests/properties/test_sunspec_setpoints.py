"""Property: whatever the battery's own scale factor and whatever the setpoint, the power a pysunspec2-built
battery holds after the daemon's write is the setpoint to within one step of that scale factor, + = discharge;
and every request lies in points its definition marks writable."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from dimmer.daemon.bus import InMemoryBus
from dimmer.daemon.devices import SunSpecBattery
from tests.budget import examples
from tests.sunspec_testdevice import PysunspecBattery

RATING_W = 500e3


@settings(max_examples=examples(60), deadline=None)
@given(
    st.sampled_from(["704", "124"]),
    st.integers(-2, 3),
    st.floats(-RATING_W, RATING_W, allow_nan=False),
    st.floats(0.1, 600.0),
)
def test_setpoint_lands_as_written(control: str, wset_sf: int, power_w: float, revert_s: float) -> None:
    dev = PysunspecBattery(control, wset_sf=wset_sf, rating_w=RATING_W, clock=lambda: 0.0)
    bus = InMemoryBus()
    bus.set_words(2, dev.base, dev.words)

    async def go() -> None:
        w = await SunSpecBattery(bus, 2, max_power_w=RATING_W).write_setpoint(power_w, revert_s)
        assert w.read_back

    asyncio.run(go())
    for unit, address, words in bus.writes:
        assert unit == 2 and dev.on_write(address, words) is None  # the device's own RW check
    step = 10.0**wset_sf if control == "704" else RATING_W * 1e-4  # 124: 0.01 % of WChaMax
    assert abs(dev.setpoint_w() - power_w) <= step / 2 + 1e-6 * abs(power_w)
