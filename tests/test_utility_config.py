"""`[utility]` of the site config (the daemon as an OpenADR VEN): every key checked at load, one line naming the
file, the key and what was expected, exit status 2 from `dimmer check`; and the OpenADR signals it plans on."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from dimmer.cli import main
from dimmer.daemon.config import validate_config
from dimmer.daemon.openadr_signals import answer
from dimmer.daemon.utility_config import UtilitySpec, check_utility, key_is_rsa
from dimmer.errors import InputError
from tests.test_daemon_config import _write, small_site

URL = "http://127.0.0.1:8080/OpenADR2/Simple/2.0b"


def with_utility(**utility: Any) -> dict[str, Any]:
    raw = small_site()
    raw["utility"] = {"vtn_url": URL, "ven_name": "campus", **utility}
    return raw


def refused(raw: dict[str, Any], base: Path = Path(".")) -> str:
    with pytest.raises(InputError) as info:
        validate_config(raw, "site.toml", base)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("site.toml: ")
    return msg


def test_a_utility_section_loads_with_its_defaults() -> None:
    loaded = validate_config(with_utility(), "site.toml", Path("."))
    u = loaded.config.utility
    assert u is not None and u.enabled and u.protocol == "openadr2b" and u.opt == "in" and u.report
    assert u.payload_scale_w == 1e3 and u.simple_levels == [1.0, 0.9, 0.75, 0.5]
    assert validate_config(small_site(), "site.toml", Path(".")).config.utility is None


@pytest.mark.parametrize(
    ("utility", "key", "expected"),
    [
        ({"vtn_url": "ftp://vtn"}, "utility.vtn_url", "an http:// or https:// URL"),
        ({"vtn_url": "vtn.example.com"}, "utility.vtn_url", "an http:// or https:// URL"),
        ({"protocol": "openadr3"}, "utility.protocol", "openadr2b"),
        ({"poll_interval_s": 0}, "utility.poll_interval_s", "greater than or equal to 1"),
        ({"report_interval_s": 1e6}, "utility.report_interval_s", "less than or equal to 3600"),
        ({"opt": "maybe"}, "utility.opt", "'in' or 'out'"),
        ({"min_limit_frac": 1.5}, "utility.min_limit_frac", "less than or equal to 1"),
        ({"payload_unit": "GW"}, "utility.payload_unit", "'W', 'kW' or 'MW'"),
        ({"simple_levels": [1.0, 0.8, 0.9]}, "utility.simple_levels", "never rise"),
        ({"simple_levels": [1.0, 0.0]}, "utility.simple_levels", "in (0, 1]"),
        ({"simple_levels": [1.0] * 5}, "utility.simple_levels", "at most 4"),
        ({"cert": "ven.pem"}, "utility", "cert, key and ca_file together"),
        ({"ca_file": "ca.pem"}, "utility", "cert, key and ca_file together"),
        ({"vtn_fingerprint": "not-one"}, "utility.vtn_fingerprint", "pattern"),
        ({"ven_nmae": "typo"}, "utility.ven_nmae", "unknown key"),
        ({"ven_name": ""}, "utility.ven_name", "at least 1 character"),
    ],
)
def test_bad_utility_keys_are_one_line_errors(utility: dict[str, Any], key: str, expected: str) -> None:
    msg = refused(with_utility(**utility))
    assert f"site.toml: {key}: " in msg and expected in msg, msg


def test_certificate_files_must_exist(tmp_path: Path) -> None:
    from tests.test_utility_openadr_tls import _issue

    tls = {"cert": "ven.pem", "key": "ven.key", "ca_file": "ca.pem"}
    msg = refused(with_utility(**tls), tmp_path)
    assert "utility.cert: an existing PEM file" in msg
    (tmp_path / "ven.pem").write_text("not a certificate")
    (tmp_path / "ven.key").write_text("x")
    (tmp_path / "ca.pem").write_text("x")
    assert refused(with_utility(**tls), tmp_path).endswith("utility.cert: PEM certificates")
    ca = _issue(tmp_path, "ca", "utility-ca", None)
    _issue(tmp_path, "ven", "campus", ca)
    good_key = (tmp_path / "ven.key").read_bytes()
    (tmp_path / "ven.key").write_bytes(good_key.replace(b"PRIVATE KEY", b"PUBLIC KEY"))
    assert refused(with_utility(**tls), tmp_path).endswith("utility.key: an unencrypted PEM private key")
    (tmp_path / "ven.key").write_bytes(good_key)
    _issue(tmp_path, "rsa", "campus", ca, kind="rsa")
    loaded = validate_config(with_utility(**tls), "site.toml", tmp_path)
    assert not key_is_rsa(tmp_path / "ven.key") and key_is_rsa(tmp_path / "rsa.key")
    assert loaded.resolve("ven.key") == tmp_path / "ven.key"


def test_a_building_daemon_leaves_the_utility_to_its_coordinator() -> None:
    cfg = validate_config(with_utility(), "site.toml", Path(".")).config
    with pytest.raises(InputError, match=r"site.toml: utility: no \[utility\] on a building daemon"):
        check_utility(cfg, "site.toml", Path("."), "building")
    for role in ("flat", "coordinator"):
        check_utility(cfg, "site.toml", Path("."), role)  # (raises for a role that may not have one)


def test_dimmer_check_exits_2_on_a_bad_utility_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, with_utility(poll_interval_s=0.5))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{path}: utility.poll_interval_s:" in err
    assert main(["check", str(_write(tmp_path, with_utility()))]) == 0
    assert f"OpenADR 2.0b VEN 'campus' of {URL}" in capsys.readouterr().out


# -- the OpenADR signals the daemon plans on (openadr_signals.answer, on events as openleadr parses them) --------------

T0 = datetime(2026, 7, 1, 18, 0, tzinfo=UTC)
LIMIT_W = 20e6


def event(*signals: dict[str, Any], status: str = "far", **period: Any) -> dict[str, Any]:
    return {
        "event_descriptor": {"event_id": "e1", "modification_number": 0, "event_status": status},
        "active_period": {"dtstart": T0, "duration": timedelta(hours=1), **period},
        "event_signals": list(signals),
        "response_required": "always",
    }


def signal(name: str, stype: str, *payloads: float, **extra: Any) -> dict[str, Any]:
    ivs = [{"duration": timedelta(minutes=30), "uid": i, "signal_payload": p} for i, p in enumerate(payloads)]
    ivs[0]["dtstart"] = T0  # the rest follow it (as on the wire: only the first interval need carry a start)
    return {"signal_name": name, "signal_type": stype, "intervals": ivs, **extra}


def spec(**kw: Any) -> UtilitySpec:
    return UtilitySpec(vtn_url=URL, ven_name="campus", **kw)


def test_openadr_signals_each_planned_on_as_documented() -> None:
    t0 = T0.timestamp()
    a = answer(
        event(signal("LOAD_CONTROL", "x-loadControlSetpoint", 16000, 14000), ramp_up=timedelta(minutes=5)),
        spec(),
        LIMIT_W,
    )
    assert a.opt == "optIn" and len(a.events) == 1
    e = a.events[0]
    assert (e.kind, e.ramp_up_s, e.start_s) == ("limit", 300.0, t0)
    assert [(iv.start_s - t0, iv.value) for iv in e.intervals] == [(0.0, 16e6), (1800.0, 14e6)]
    cases = [
        (signal("SIMPLE", "level", 2), "limit", 0.75 * LIMIT_W),
        (signal("simple", "level", 9), "limit", 0.5 * LIMIT_W),  # beyond the table: its last level
        (signal("LOAD_CONTROL", "x-loadControlCapacity", 0.8), "limit", 0.8 * LIMIT_W),
        (signal("LOAD_DISPATCH", "setpoint", 15), "target", 15e6),  # its item base: MW
        (signal("x-rampLimit", "setpoint", 2000), "ramp", 2e6),
    ]
    for sig, kind, value in cases:
        if sig["signal_name"] == "LOAD_DISPATCH":
            sig["measurement"] = {"name": "powerReal", "unit": "W", "scale": "M"}
        got = answer(event(sig), spec(), LIMIT_W)
        assert got.opt == "optIn" and got.events[0].kind == kind, sig
        assert got.events[0].intervals[0].value == pytest.approx(value), sig


def test_openadr_events_opted_out_of() -> None:
    price = signal("ELECTRICITY_PRICE", "price", 0.3)
    assert answer(event(price), spec(), LIMIT_W).opt == "optOut"  # nothing planned on
    deep = event(signal("LOAD_CONTROL", "x-loadControlSetpoint", 4000))
    assert answer(deep, spec(), LIMIT_W).opt == "optIn"
    out = answer(deep, spec(min_limit_frac=0.5), LIMIT_W)
    assert out.opt == "optOut" and "min_limit_frac" in out.why and not out.events
    assert answer(deep, spec(opt="out"), LIMIT_W).opt == "optOut"
    bad = event(signal("LOAD_CONTROL", "x-loadControlSetpoint", math.nan))
    assert answer(bad, spec(), LIMIT_W).opt == "optOut"
    naive = event(signal("LOAD_CONTROL", "x-loadControlSetpoint", 4000))
    naive["event_signals"][0]["intervals"][0]["dtstart"] = T0.replace(tzinfo=None)
    assert answer(naive, spec(), LIMIT_W).opt == "optOut"
    cancelled = answer(event(price, status="cancelled"), spec(), LIMIT_W)
    assert cancelled.cancelled and not cancelled.events


def test_an_open_ended_interval_lasts_until_cancelled() -> None:
    ev = event(signal("LOAD_CONTROL", "x-loadControlSetpoint", 12000))
    ev["event_signals"][0]["intervals"][0]["duration"] = timedelta(0)
    e = answer(ev, spec(), LIMIT_W).events[0]
    assert math.isinf(e.end_s)
