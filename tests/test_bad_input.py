"""Issue 12, items 2, 6, 7 and 9: bad input through the real command lines gets one line, exit status 2, and
nothing written.

2: `gridsim validate` reads every trace and frequency file and builds every `[controllers.<name>]` table, so what
   it accepts a run accepts, and what a run refuses it refuses with the same line.
6: nesting, input file size and kind, ticks, racks and a run's memory are bounded, the limit said in the error.
7: output paths are checked before anything runs; a write that fails is one line; a killed run's staging directory
   is removed by the next run.
9: names that would leave out/ or carry control characters are refused at load; a trace error never echoes the file.
10: every numeric option of both command lines is finite and in its documented range, refused as it is parsed
   (`dimmer agent`'s are in tests/test_agent.py); `--set` with a 5,000-digit value, `--dask '::::'` likewise.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dimmer.inputfile import MAX_TOML_BYTES
from dimmer.outpath import remove_stale_stages
from gridsim.cli import main
from gridsim.scenario import MAX_RUN_BYTES, MAX_TICKS

from .conftest import MINIMAL_SCENARIO as MINIMAL

TRACE_JOB = MINIMAL.replace("gpus = 256", 'gpus = 256\nkind = "trace"\ntrace_path = "trace.csv"')
REPLAY = MINIMAL + '[[events]]\nkind = "frequency_replay"\nat_s = 1\npath = "freq.csv"\n'
SECRET = "root:$6$SECRETHASH:20228:0:99999:7:::"


def _scenario(tmp_path: Path, text: str, name: str = "sc.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, repr(err)
    return err.strip()


def _main(argv: list[str]) -> int | str | None:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse refuses an argument by exiting, as the command line does
        return exc.code


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], *parts: str, status: int = 2) -> str:
    assert _main(argv) == status
    line = _one_line(capsys)
    for part in parts:
        assert part in line, line
    return line


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the default --out is out/<name>-<controller> in the working directory: keep it in tmp_path, to look at it
    monkeypatch.chdir(tmp_path)


def _nothing_written(tmp_path: Path, before: set[str]) -> None:
    assert {p.name for p in tmp_path.iterdir()} == before
    assert not (tmp_path / "out").exists()


# -- item 2: validate checks what run checks -----------------------------------------------------------------


BAD_FILES = {
    "garbage": os.urandom(300),
    "redfish log": b'{"@odata.type": "#LogEntry.v1_15_0.LogEntry", "Created": "2025-01-01T00:00:00Z"}\n',
    "shadow": (SECRET + "\ndaemon:*:20228:0:99999:7:::\n").encode(),
    "empty": b"",
}


@pytest.mark.parametrize("content", list(BAD_FILES.values()), ids=list(BAD_FILES))
def test_validate_reads_the_trace_file_and_run_refuses_it_with_the_same_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    sc = _scenario(tmp_path, TRACE_JOB)
    (tmp_path / "trace.csv").write_bytes(content)
    before = {p.name for p in tmp_path.iterdir()}
    line = _refused(["validate", str(sc)], capsys, f"{sc}: jobs[0].trace_path: ")
    assert "SECRET" not in line  # what was expected, never what the file holds
    assert _refused(["run", str(sc), "--quiet"], capsys) == line
    _nothing_written(tmp_path, before)


@pytest.mark.parametrize("content", list(BAD_FILES.values()), ids=list(BAD_FILES))
def test_validate_reads_the_frequency_replay_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    sc = _scenario(tmp_path, REPLAY)
    (tmp_path / "freq.csv").write_bytes(content)
    before = {p.name for p in tmp_path.iterdir()}
    line = _refused(["validate", str(sc)], capsys, f"{sc}: events[0].path: ")
    # the run fails at load, before it simulates up to the event
    assert _refused(["run", str(sc), "--quiet"], capsys) == line
    _nothing_written(tmp_path, before)


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ("[controllers.dimmer]\nbogus_frac = 1\n", "controllers.dimmer.bogus_frac"),
        ("[controllers.dimmer]\nperiod_s = -1\n", "controllers.dimmer.period_s"),
        ("[controllers.none]\nx = 1\n", "controllers.none.x"),
        ('[controllers.dynamo]\nleaf_period_s = "fast"\n', "controllers.dynamo.leaf_period_s"),
        ("[controllers.nonesuch]\nx = 1\n", "controllers.nonesuch"),
        ('[controller]\nname = "nonesuch"\n', "controller.name"),
        ('[controller]\nname = "dimmer"\nbogus = 1\n', "controller.bogus"),
    ],
)
def test_validate_checks_every_controller_table_against_its_params_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], table: str, key: str
) -> None:
    sc = _scenario(tmp_path, MINIMAL + table)
    before = {p.name for p in tmp_path.iterdir()}
    line = _refused(["validate", str(sc)], capsys, f"{sc}: {key}: ")
    assert _refused(["run", str(sc), "--quiet"], capsys) == line
    _nothing_written(tmp_path, before)


def test_a_good_controller_table_and_a_multi_line_description_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = MINIMAL.replace('name = "tiny"', 'name = "tiny"\ndescription = """two\nlines,\ta tab"""')
    sc = _scenario(tmp_path, text + '[controller]\nname = "dimmer"\n[controllers.dimmer]\nperiod_s = 1.0\n')
    assert main(["validate", str(sc)]) == 0
    assert ": ok — tiny" in capsys.readouterr().out


# -- item 6: bounded sizes ---------------------------------------------------------------------------------------


def test_deeply_nested_toml_is_refused_in_every_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    deep = _scenario(tmp_path, MINIMAL + "x = " + "[" * 5000 + "]" * 5000 + "\n")
    moderate = _scenario(tmp_path, MINIMAL + "x = " + "[" * 200 + "]" * 200 + "\n", "moderate.toml")
    for sc in (deep, moderate):
        for cmd in ("validate", "describe", "run", "compare"):
            _refused([cmd, str(sc)], capsys, f"{sc}: (syntax): TOML nested at most 32")
    _refused(["validate", str(_scenario(tmp_path, MINIMAL, "ok.toml")), "--set", "x=" + "[" * 3000 + "]" * 3000],
             capsys, "--set: ", "nested at most 32")  # fmt: skip


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_a_device_is_refused_unread(capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["validate", "/dev/zero"], capsys, "/dev/zero: (file): a regular file")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "sc.toml"
    os.mkfifo(fifo)
    _refused(["validate", str(fifo)], capsys, f"{fifo}: (file): a regular file")
    sc = _scenario(tmp_path, TRACE_JOB, "t.toml")
    os.mkfifo(tmp_path / "trace.csv")
    _refused(["validate", str(sc)], capsys, "jobs[0].trace_path: a regular file")


def test_a_scenario_file_larger_than_the_limit_is_refused_unread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sc = _scenario(tmp_path, MINIMAL + ("# padding\n" * (MAX_TOML_BYTES // 10 + 1)))
    _refused(["validate", str(sc)], capsys, f"{sc}: (file): a scenario file of at most 4.0 MiB")


@pytest.mark.parametrize(
    ("sets", "key", "expected"),
    [
        (["engine.tick_s=1e-9"], "engine.tick_s", "greater than or equal to 0.001"),
        (["engine.tick_s=0.001", "duration_s=2592000"], "engine.tick_s", f"at most {MAX_TICKS:,} ticks"),
        (["duration_s=2592000"], "duration_s", f"at most {MAX_TICKS:,} ticks"),
        (["site.levels[0].count=100000", "site.levels[1].count=100000"], "site.levels", "at most 100,000 racks"),
        (
            [
                "site.levels[0].count=1000",
                "site.levels[1].count=100",
                "engine.record_racks=100000",
                "duration_s=36000",
                "engine.control_period_s=0.1",
            ],
            "engine.record_racks",
            f"at most {MAX_RUN_BYTES / 1024**3:g} GiB",
        ),
    ],
)
def test_sizes_that_exhaust_memory_are_refused_with_the_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sets: list[str], key: str, expected: str
) -> None:
    sc = _scenario(tmp_path, MINIMAL)
    before = {p.name for p in tmp_path.iterdir()}
    argv = [x for s in sets for x in ("--set", s)]
    line = _refused(["validate", str(sc), *argv], capsys, f"{sc}: {key}: ", expected)
    assert _refused(["run", str(sc), "--quiet", *argv], capsys) == line
    _nothing_written(tmp_path, before)


# -- item 7: output paths ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["run", "compare"])
def test_an_unusable_out_is_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cmd: str
) -> None:
    sc = _scenario(tmp_path, MINIMAL)
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    before = {p.name for p in tmp_path.iterdir()}
    _refused([cmd, str(sc), "--out", str(afile), "--quiet"], capsys, f"--out: {afile}: a directory")
    _refused([cmd, str(sc), "--out", str(afile / "sub"), "--quiet"], capsys, f"{afile} is a file")
    _refused([cmd, str(sc), "--out", "", "--quiet"], capsys, "--out", "not an empty string")
    assert afile.read_text() == "keep me\n"
    _nothing_written(tmp_path, before)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_out_is_refused_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sc = _scenario(tmp_path, MINIMAL)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        _refused(["run", str(sc), "--out", str(ro / "x"), "--quiet"], capsys, "not writable")
        _refused(["run", str(sc), "--out", str(ro), "--quiet"], capsys, "not writable")
    finally:
        ro.chmod(0o700)
    assert list(ro.iterdir()) == []


def test_a_full_disk_is_one_line_and_leaves_no_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pandas as pd

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    sc = _scenario(tmp_path, MINIMAL)
    monkeypatch.setattr(pd.DataFrame, "to_csv", full)
    out = tmp_path / "res"
    _refused(["run", str(sc), "--out", str(out), "--quiet"], capsys, f"{out}: cannot write: ", "No space left",
             status=1)  # fmt: skip
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if "staging" in p.name] == []


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_runs_stage_is_removed_by_the_next_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sc = _scenario(tmp_path, MINIMAL)
    out = tmp_path / "res"
    dead = tmp_path / f".res.staging-{_dead_pid()}-abcd1234"
    live = tmp_path / ".res.staging-1-abcd1234"  # pid 1 always runs: another run in progress, kept
    other = tmp_path / ".res.somethingelse"
    for d in (dead, live, other):
        d.mkdir()
        (d / "summary.json").write_text("{}")
    assert main(["run", str(sc), "--out", str(out), "--quiet"]) == 0
    assert (out / "summary.json").is_file()
    assert not dead.exists() and live.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if "staging" in p.name) == [live.name]


def test_stale_stages_are_only_ours(tmp_path: Path) -> None:
    mine = tmp_path / f".x.staging-{os.getpid()}-a"  # this process's own: in use
    odd = tmp_path / ".x.staging-notapid-a"
    afile = tmp_path / f".x.staging-{_dead_pid()}-f"
    for d in (mine, odd):
        d.mkdir()
    afile.write_text("a file, not a stage")
    assert remove_stale_stages(tmp_path, "x") == []
    assert mine.exists() and odd.exists() and afile.exists()


# -- item 9: names -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ('name = "tiny"', 'name = "../escaped"', "name"),
        ('name = "tiny"', 'name = "/tmp/escaped"', "name"),
        ('name = "tiny"', 'name = "a\\\\b"', "name"),
        ('name = "tiny"', 'name = "tiny\\nwrote"', "name"),
        ('name = "j"', 'name = "j\\nforged,row"', "jobs[0].name"),
        ('name = "j"', 'name = "j\\u0000"', "jobs[0].name"),
        ('name = "j"', 'name = "j\\u001b[2J"', "jobs[0].name"),
        ('name = "j"', 'name = "j\\tk"', "jobs[0].name"),
        ('name = "tiny"', 'name = "tiny"\ndescription = "two\\nlines \\u001b]0;title\\u0007"', "description"),
    ],
)
def test_names_that_leave_out_or_carry_control_characters_are_refused_at_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str, key: str
) -> None:
    sc = _scenario(tmp_path, MINIMAL.replace(old, new))
    before = {p.name for p in tmp_path.iterdir()}
    line = _refused(["validate", str(sc)], capsys, f"{sc}: {key}: ")
    assert "\x1b" not in line and "\x00" not in line
    assert _refused(["run", str(sc), "--quiet"], capsys) == line
    _nothing_written(tmp_path, before)
    assert not (tmp_path.parent / "escaped-none").exists()


def test_a_sweep_name_that_leaves_out_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _scenario(tmp_path, MINIMAL)
    sweep = tmp_path / "sw.toml"
    sweep.write_text('scenario = "sc.toml"\nname = "../../escaped"\n[grid]\nduration_s = [5, 10]\n')
    before = {p.name for p in tmp_path.iterdir()}
    _refused(["sweep", str(sweep), "--quiet"], capsys, f"{sweep}: name: ", "without / or")
    _nothing_written(tmp_path, before)


# -- item 7: the other commands' outputs; `dimmer check` opens what `dimmer run` opens --------------------------


def test_serve_and_run_sim_refuse_an_unusable_out_before_serving(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dimmer.cli import main as dimmer_main

    sc = _scenario(tmp_path, MINIMAL)
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    before = {p.name for p in tmp_path.iterdir()}
    _refused(["serve", str(sc), "--port", "0", "--out", str(afile)], capsys, f"--out: {afile}: a directory")
    _refused(["serve", str(sc), "--port", "0", "--out", ""], capsys, "not an empty string")
    assert dimmer_main(["run", "--sim", str(sc), "--out", str(afile / "sub"), "--quiet"]) == 2
    assert f"dimmer: --out: {afile / 'sub'}: a path below directories only" in _one_line(capsys)
    assert afile.read_text() == "keep me\n"
    _nothing_written(tmp_path, before)


def test_agent_sim_gpus_is_bounded_by_a_rack(capsys: pytest.CaptureFixture[str]) -> None:
    from dimmer.cli import main as dimmer_main
    from dimmer.siteconfig import MAX_GPUS_PER_RACK

    for n in (0, MAX_GPUS_PER_RACK + 1, 1_000_000_000):
        with pytest.raises(SystemExit) as info:  # refused as it is parsed (item 10): 0 no longer means NVML
            dimmer_main(["agent", "--sim-gpus", str(n), "--port", "0"])
        assert info.value.code == 2
        assert f"dimmer: --sim-gpus: a number of GPUs (one rack's) in 1..{MAX_GPUS_PER_RACK}" in _one_line(capsys)


# -- item 10: numbers and addresses refused as they are parsed ---------------------------------------------------


def _dimmer(argv: list[str]) -> int | str | None:
    from dimmer.cli import main as dimmer_main

    try:
        return dimmer_main(argv)
    except SystemExit as exc:
        return exc.code


BIG = "9" * 5000
BAD_GRIDSIM_ARGS = [
    (["run", "sc.toml", "--seed", "-1"], "--seed: "),
    (["run", "sc.toml", "--seed", BIG], "--seed: "),
    (["compare", "sc.toml", "--seed", "1.5"], "--seed: "),
    (["run", "sc.toml", "--set", f"duration_s={BIG}"], "--set: duration_s: a number of at most"),
    (["validate", "sc.toml", "--set", f"seed={BIG}"], "--set: seed: a number of at most"),
    (["serve", "sc.toml", "--speed", "1e-300"], "--speed: "),
    (["serve", "sc.toml", "--speed", "1e300"], "--speed: "),
    (["serve", "sc.toml", "--speed", "nan"], "--speed: "),
    (["serve", "sc.toml", "--port", "-1"], "--port: "),
    (["serve", "sc.toml", "--seed", BIG], "--seed: "),
    (["serve", "sc.toml", "--max-connections", "0"], "--max-connections: "),
    (["serve", "sc.toml", "--idle-timeout-s", "inf"], "--idle-timeout-s: "),
    (["sweep", "sw.toml", "--dask", "::::"], "--dask: a scheduler address"),
    (["sweep", "sw.toml", "--dask", "tcp://"], "--dask: a scheduler address"),
    (["sweep", "sw.toml", "--dask", "sched:99999"], "--dask: a scheduler address"),
    (["sweep", "sw.toml", "--workers", "0"], "--workers: "),
    (["sweep", "sw.toml", "--workers", BIG], "--workers: "),
]


@pytest.mark.parametrize(
    ("argv", "part"), BAD_GRIDSIM_ARGS, ids=lambda v: " ".join(v)[:40] if isinstance(v, list) else None
)
def test_gridsim_numbers_and_addresses_are_refused_as_parsed(
    argv: list[str], part: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _scenario(tmp_path, MINIMAL)
    before = {p.name for p in tmp_path.iterdir()}
    line = _refused(argv, capsys, part)
    assert line.startswith("gridsim: --") and len(line) < 300, line  # the option first; never 5,000 digits
    _nothing_written(tmp_path, before)


BAD_RUN_SIM_ARGS = [
    (["--speed", "1e-300"], "--speed: "),
    (["--speed", "inf"], "--speed: "),
    (["--speed", "1000"], "--speed: "),
    (["--seed", "-1"], "--seed: "),
    (["--seed", BIG], "--seed: "),
    (["--set", f"duration_s={BIG}"], "--set: duration_s: a number of at most"),
]


@pytest.mark.parametrize(
    ("extra", "part"), BAD_RUN_SIM_ARGS, ids=lambda v: " ".join(v)[:30] if isinstance(v, list) else None
)
def test_run_sim_numbers_are_refused_before_anything_starts(
    extra: list[str], part: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _scenario(tmp_path, MINIMAL)
    before = {p.name for p in tmp_path.iterdir()}
    assert _dimmer(["run", "--sim", "sc.toml", "--quiet", *extra]) == 2
    line = _one_line(capsys)
    assert line.startswith("dimmer: " + part) and len(line) < 300, line
    _nothing_written(tmp_path, before)


def test_a_5000_digit_number_in_a_scenario_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sc = _scenario(tmp_path, MINIMAL.replace("duration_s = 10", f"duration_s = {BIG}"))
    _refused(["validate", str(sc)], capsys, f"{sc}: (syntax): numbers of at most")


def test_the_serve_entry_run_sim_spawns_refuses_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gridsim.serve import main_serve

    _scenario(tmp_path, MINIMAL)
    assert main_serve(["sc.toml", "--port", "x"]) == 2  # was argparse's usage and the error: two lines
    assert _one_line(capsys).startswith("gridsim: --port: a TCP port in 0..65535")
    assert main_serve(["sc.toml", "--nope"]) == 2
    assert "unrecognized arguments: --nope" in _one_line(capsys)


def _site_config(tmp_path: Path, daemon: dict[str, str]) -> Path:
    from tests.test_daemon_config import _write, small_site

    raw = small_site()
    raw["daemon"] = {"metrics_address": "", **daemon}
    return _write(tmp_path, raw)


@pytest.mark.parametrize("key", ["audit_log", "state_file"])
def test_check_and_run_refuse_an_audit_log_or_state_file_the_daemon_cannot_open(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    from dimmer.cli import main as dimmer_main

    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("keep me\n")
    for value, expected in (("adir", "a file, not a directory"), ("afile/x.json", "is a file")):
        cfg = _site_config(tmp_path, {key: value})
        before = sorted(p.name for p in tmp_path.rglob("*"))
        assert dimmer_main(["check", str(cfg)]) == 2
        line = _one_line(capsys)
        assert line.startswith(f"dimmer: {cfg}: daemon.{key}: ") and expected in line, line
        # `run` refuses it with the same line, before it touches a device
        assert dimmer_main(["run", "--config", str(cfg), "--dry-run"]) == 2
        assert _one_line(capsys) == line
        assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "afile").read_text() == "keep me\n"


def test_check_accepts_files_in_a_directory_the_daemon_will_make(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dimmer.cli import main as dimmer_main

    cfg = _site_config(tmp_path, {"audit_log": "logs/new/audit.jsonl", "state_file": "state.json"})
    assert dimmer_main(["check", str(cfg)]) == 0
    assert ": ok — " in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site.toml"]  # checking creates nothing


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into a read-only directory")
def test_check_refuses_an_audit_log_in_a_read_only_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dimmer.cli import main as dimmer_main

    ro = tmp_path / "ro"
    ro.mkdir()
    cfg = _site_config(tmp_path, {"audit_log": "ro/audit.jsonl"})
    ro.chmod(0o500)
    try:
        assert dimmer_main(["check", str(cfg)]) == 2
        assert "daemon.audit_log: " in _one_line(capsys)
    finally:
        ro.chmod(0o700)


def test_a_device_name_with_control_characters_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dimmer.cli import main as dimmer_main

    cfg = _site_config(tmp_path, {})
    # "\n" inside a TOML basic string is a line break in the value: a name that would forge a log or metrics line
    cfg.write_text(cfg.read_text().replace('kind = "meter"', 'kind = "meter"\nname = "pcc\\nforged"', 1))
    assert dimmer_main(["check", str(cfg)]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"dimmer: {cfg}: devices[0].name: ") and "control characters" in line, line
