"""The daemon's site config: one-line errors naming the file and key (exit 2), cross-checks, `dimmer check`."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dimmer.cli import main
from dimmer.daemon.config import controller_params, load_config, validate_config
from dimmer.errors import InputError

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "site.toml"


def small_site() -> dict[str, Any]:
    """16 racks (2 rows x 8), one job, a meter, a battery, two rack devices."""
    return {
        "site": {
            "gpu": "gb300",
            "pcc": {"limit_mw": 2.0, "ramp_mw_per_min": 0.4},
            "levels": [
                {"level": "hall", "count": 1, "rating_mw": 2.1},
                {"level": "row", "count": 2, "rating_kw": 1100},
                {"level": "rack", "count": 8},
            ],
            "storage": {"bess": {"power_mw": 0.5, "energy_mwh": 0.25}},
        },
        "jobs": [{"name": "pretrain", "priority": 10, "gpus": 960}],
        "devices": [
            {"kind": "meter", "host": "127.0.0.1", "port": 1502, "unit": 1},
            {"kind": "battery", "host": "127.0.0.1", "port": 1502, "unit": 2},
            {"kind": "racks", "host": "127.0.0.1", "port": 1502, "unit": 3, "first_rack": 0, "n_racks": 8},
            {"kind": "racks", "host": "127.0.0.1", "port": 1502, "unit": 4, "first_rack": 8, "n_racks": 8},
        ],
    }


def check(raw: dict[str, Any]) -> InputError:
    with pytest.raises(InputError) as info:
        validate_config(raw, "site.toml", Path("."))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("site.toml: ")
    return info.value


def test_example_is_valid() -> None:
    loaded = load_config(EXAMPLE)
    assert loaded.site.n_racks == 16
    assert loaded.device_names == ("pcc-meter", "bess", "row0", "row1")
    # the operating limit lowers row 1 below its 1100 kW breaker
    assert loaded.limit_w[loaded.site.domain_index("h0/r1")] == pytest.approx(1.0e6)
    assert loaded.limit_w[loaded.site.domain_index("h0/r0")] == pytest.approx(1.1e6)
    assert loaded.safe_cap_w == pytest.approx(0.6 * 1400.0)
    assert loaded.audit_path == Path("/var/log/dimmer/audit.jsonl")


def test_defaults_and_relative_paths(tmp_path: Path) -> None:
    raw = small_site()
    raw["daemon"] = {"audit_log": "logs/audit.jsonl", "state_file": "state.json"}
    loaded = validate_config(raw, "x.toml", tmp_path)
    d = loaded.config.daemon
    assert d.period_s == 1.0 and d.metrics_address == "127.0.0.1:9108"
    assert loaded.audit_path == tmp_path / "logs" / "audit.jsonl"
    assert loaded.state_path == tmp_path / "state.json"
    assert loaded.device_names == ("meter0", "battery1", "racks2", "racks3")
    # the dimmer controller gets the daemon's period and the [safety] staleness and safe cap
    params = controller_params(loaded.config)
    assert params == {"period_s": 1.0, "stale_s": 5.0, "safe_cap_frac": 0.6}


@pytest.mark.parametrize(
    ("mutate", "key", "expected"),
    [
        (lambda r: r["devices"][2].update(n_racks=7), "devices", "racks 7"),
        (lambda r: r["devices"][3].update(first_rack=7), "devices[3].first_rack", "rack 7 repeats"),
        (lambda r: r["devices"][3].update(n_racks=9), "devices[3].n_racks", "0..15"),
        (lambda r: r["devices"][2].pop("first_rack"), "devices[2]", "first_rack and n_racks"),
        (lambda r: r["devices"][0].update(first_rack=0), "devices[0]", "racks devices only"),
        (lambda r: r["devices"][0].update(unit=0), "devices[0].unit", "greater than or equal to 1"),
        (lambda r: r["devices"][0].update(unit=248), "devices[0].unit", "less than or equal to 247"),
        (lambda r: r["devices"][0].update(port=70000), "devices[0].port", "less than or equal to 65535"),
        (lambda r: r["devices"][0].update(kind="inverter"), "devices[0].kind", "'meter'"),
        (lambda r: r["devices"][0].update(profile="dimmer-rack-v1"), "devices[0]", "sunspec"),
        (lambda r: r["devices"][0].update(domain="h0/r9"), "devices[0].domain", "a domain of the site"),
        (lambda r: r["devices"][0].update(hots="x"), "devices[0].hots", "unknown key"),
        (lambda r: r["devices"].append(dict(r["devices"][1])), "devices[4].kind", "at most one battery"),
        (lambda r: r["devices"][1].update(kind="meter", domain="campus"), "devices[1].domain", "one meter per domain"),
        (lambda r: r["devices"][1].update(unit=1, kind="meter", domain="h0"), "devices[1].unit", "a unit no other"),
        (lambda r: r["devices"].pop(0), "devices", "interconnect must be measured"),
        (lambda r: r.update(safety={"safe_cap_frac": 1.2}), "safety.safe_cap_frac", "above the gb300 rating"),
        (lambda r: r.update(safety={"safe_cap_frac": 0.1}), "safety.safe_cap_frac", "settable from 200 W"),
        (lambda r: r.update(safety={"lease_s": 0.5}), "safety.lease_s", "at least the period"),
        (lambda r: r.update(limits=[{"domain": "h0/r0", "limit_kw": 1200}]), "limits[0].limit_kw", "breaker rating"),
        (lambda r: r.update(limits=[{"domain": "campus", "limit_mw": 2.5}]), "limits[0].limit_mw", "interconnect"),
        (lambda r: r.update(limits=[{"domain": "nowhere", "limit_kw": 1}]), "limits[0].domain", "a domain"),
        (lambda r: r.update(controller={"name": "pid"}), "controller.name", "one of"),
        (lambda r: r.update(controller={"params": {"soft_frac": 2}}), "controller.params.soft_frac", "less than 1"),
        (lambda r: r.update(controller={"params": {"sfot_frac": 0.9}}), "controller.params.sfot_frac", "unknown"),
        (lambda r: r.update(daemon={"metrics_address": "localhost"}), "daemon.metrics_address", "host:port"),
        (lambda r: r.update(daemon={"period_s": 0}), "daemon.period_s", "greater than 0"),
        (lambda r: r["jobs"][0].update(gpus=10**6), "jobs[0].gpus", "racks"),
        (lambda r: r["site"].update(gpu="a100"), "site", "gpu must be one of"),
    ],
)
def test_errors_name_the_key(mutate: Any, key: str, expected: str) -> None:
    raw = copy.deepcopy(small_site())
    mutate(raw)
    err = check(raw)
    assert err.key == key, str(err)
    assert expected in err.expected, str(err)


def test_safe_cap_limits_are_the_gpu_range() -> None:
    raw = small_site()
    lo = 200.0 / 1400.0
    raw["safety"] = {"safe_cap_frac": lo + 1e-6}
    assert validate_config(raw, "x", Path(".")).safe_cap_w == pytest.approx(200.0, abs=0.01)
    raw["safety"] = {"safe_cap_frac": 1.0}
    assert validate_config(raw, "x", Path(".")).safe_cap_w == pytest.approx(1400.0)


def test_rack_blocks_may_share_a_unit() -> None:
    raw = small_site()
    raw["devices"][3]["unit"] = 3  # one rack controller, two blocks of its racks
    loaded = validate_config(raw, "x", Path("."))
    assert np.array_equal(loaded.limit_w, loaded.site.domain_rating_w)


def _write(tmp_path: Path, raw: dict[str, Any]) -> Path:
    """Serialise the small test configs (flat values and lists of tables only) as TOML."""
    lines: list[str] = []

    def val(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return f'"{v}"'
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return repr(v)

    def table(prefix: str, d: dict[str, Any]) -> None:
        lines.append(f"[{prefix}]")
        subs = []
        for k, v in d.items():
            if isinstance(v, dict) or (isinstance(v, list) and v and isinstance(v[0], dict)):
                subs.append((k, v))
            else:
                lines.append(f"{k} = {val(v)}")
        for k, v in subs:
            if isinstance(v, dict):
                table(f"{prefix}.{k}", v)
            else:
                for item in v:
                    lines.append(f"[[{prefix}.{k}]]")
                    lines.extend(f"{kk} = {val(vv)}" for kk, vv in item.items())

    for k, v in raw.items():
        if isinstance(v, dict):
            table(k, v)
        else:
            for item in v:
                lines.append(f"[[{k}]]")
                lines.extend(f"{kk} = {val(vv)}" for kk, vv in item.items())
    path = tmp_path / "site.toml"
    path.write_text("\n".join(lines) + "\n")
    assert tomllib.loads(path.read_text()) == raw  # the writer is right, so the test checks the loader
    return path


def test_check_command_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, small_site())
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "ok" in out and "16 racks" in out and "controller dimmer" in out


def test_check_command_bad_input_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = small_site()
    raw["devices"][3]["first_rack"] = 4
    path = _write(tmp_path, raw)
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err == f"dimmer: {path}: devices[3].first_rack: racks no other device serves (rack 4 repeats)"


def test_check_missing_file_and_bad_toml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(tmp_path / "nope.toml")]) == 2
    assert "(file): an existing site config file" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[site\n")
    assert main(["check", str(bad)]) == 2
    assert "(syntax): valid TOML" in capsys.readouterr().err


def test_check_touches_no_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    def no_network(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("dimmer check opened a socket")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    assert main(["check", str(_write(tmp_path, small_site()))]) == 0
