from __future__ import annotations

from pathlib import Path

import pytest

from dimmer.errors import InputError
from gridsim.cli import main
from gridsim.scenario import apply_overrides, load_scenario, parse_override
from tests.conftest import skip_without_shared_data

from .conftest import MINIMAL_SCENARIO as MINIMAL
from .conftest import SCENARIOS

LIBRARY = sorted(SCENARIOS.glob("*.toml"))


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "sc.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", LIBRARY, ids=[p.stem for p in LIBRARY])
def test_library_scenario_validates(path: Path) -> None:
    skip_without_shared_data(path)
    loaded = load_scenario(path)
    assert loaded.site().n_racks > 0


def test_minimal_scenario_loads(tmp_path: Path) -> None:
    loaded = load_scenario(_write(tmp_path, MINIMAL))
    site = loaded.site()
    assert (site.n_racks, site.n_jobs) == (8, 1)


@pytest.mark.parametrize(
    ("edit", "key", "expected"),
    [
        (("limit_mw = 2.0", "limit_kw = 2000"), "site.pcc.limit_kw", "unknown key"),
        (("rating_kw = 600", "rating_kw = -600"), "site.levels[0].rating_kw", "greater than 0"),
        (("gpus = 256", "racks = [4, 40]"), "jobs[0].racks", "racks 0..7"),
        (("gpus = 256", "gpus = 100000"), "jobs[0].gpus", "racks are free"),
        (("duration_s = 10", 'duration_s = "long"'), "duration_s", "valid number"),
        (
            ('name = "j"', 'name = "j"\nkind = "trace"\ntrace_path = "nope.csv"'),
            "jobs[0].trace_path",
            "existing",
        ),
        (
            ("count = 4", 'count = 4\n[[events]]\nkind = "crash"\nat_s = 1\njobs = ["x"]'),
            "events[0].jobs",
            "names",
        ),
        (("count = 4", 'count = 4\n[[events]]\nkind = "meteor"\nat_s = 1'), "events[0]", "tag"),
    ],
)
def test_bad_scenario_one_line_exit_2_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: tuple[str, str], key: str, expected: str
) -> None:
    path = _write(tmp_path, MINIMAL.replace(*edit, 1))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith(f"gridsim: {path}: {key}")
    assert expected in err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["sc.toml"]


def test_bad_toml_syntax(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "name = \n")
    assert main(["validate", str(path)]) == 2
    assert "(syntax): valid TOML" in capsys.readouterr().err


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(tmp_path / "absent.toml")]) == 2
    assert "an existing scenario file" in capsys.readouterr().err


def test_bad_argument_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_overrides_parse_and_apply() -> None:
    assert parse_override("jobs[0].gpus=4096") == (["jobs", 0, "gpus"], 4096)
    assert parse_override("controller.name=none") == (["controller", "name"], "none")
    raw = apply_overrides({"jobs": [{"gpus": 1}]}, ["jobs[0].gpus=8", "engine.tick_s=0.05"])
    assert raw == {"jobs": [{"gpus": 8}], "engine": {"tick_s": 0.05}}
    with pytest.raises(InputError, match="existing list item"):
        apply_overrides({"jobs": []}, ["jobs[3].gpus=1"])
    with pytest.raises(InputError, match="KEY=VALUE"):
        parse_override("duration_s")


def test_override_is_validated_like_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, MINIMAL)
    assert main(["validate", str(path), "--set", "engine.tick_s=-1"]) == 2
    assert "engine.tick_s" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            "timestamp, power.draw [W]\r\n2025/12/10 17:40:10.592, 18.14 W\r\n2025/12/10 17:40:10.6, lots W\r\n",
            "trace.csv:3",
        ),
        ("time,power\n1,2\n", "trace.csv:2"),  # a time,power CSV now (docs/models.md), whose time is not ISO 8601
        ("when, watts\n1, 2\n", "header"),
        ("", "empty"),
    ],
)
def test_malformed_trace_file_is_one_line_exit_2_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, expected: str
) -> None:
    (tmp_path / "trace.csv").write_text(content, newline="")
    path = _write(tmp_path, MINIMAL.replace('name = "j"', 'name = "j"\nkind = "trace"\ntrace_path = "trace.csv"'))
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "jobs[0].trace_path" in err and expected in err.lower()
    assert not out.exists()


def _raise_input_error(source: str) -> None:
    raise InputError(source, "jobs[0].gpus", "a positive integer")


def test_an_input_error_crosses_a_process_pool_whole() -> None:
    """A sweep or a site suite runs points in worker processes: the error a worker raises must arrive as the same
    one-line InputError (it used to break the pool: its constructor could not be called with the message alone)."""
    import pickle
    from concurrent.futures import ProcessPoolExecutor

    err = pickle.loads(pickle.dumps(InputError("a.toml", "jobs[0].gpus", "a positive integer")))
    assert (err.source, err.key, err.expected) == ("a.toml", "jobs[0].gpus", "a positive integer")
    with ProcessPoolExecutor(max_workers=1) as pool:
        fut = pool.submit(_raise_input_error, "b.toml")
        with pytest.raises(InputError, match=r"^b\.toml: jobs\[0\]\.gpus: a positive integer$"):
            fut.result()
