"""The result table of a sweep, one row per point (its grid values, then its summary), and the plain answer read
from it: which sizes, or which controllers, hold the limits, and at what cost in goodput.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gridsim.compare import csv_cell
from gridsim.metrics import SUMMARY_KEYS
from gridsim.sweep.plan import CONTROLLER_KEY, Scalar, SweepPlan, _fmt_value

GOODPUT_OK_PCT = 1.0  # the answer's second question: the smallest size that holds the limits losing less than this


def result_columns(plan: SweepPlan) -> list[str]:
    """run_id, the grid keys, then every summary key not already a grid key (controller, seed, duration_s)."""
    grid = list(plan.axes)
    return ["run_id", *grid, *(k for k in SUMMARY_KEYS if k not in grid)]


def result_rows(plan: SweepPlan, summaries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per point, in grid order: its grid values (as asked) and its summary."""
    rows = []
    for p in plan.points:
        s = summaries[p.run_id]
        rows.append({"run_id": p.run_id, **p.values, **{k: v for k, v in s.items() if k not in p.values}})
    return rows


def results_csv(plan: SweepPlan, rows: Sequence[dict[str, Any]]) -> str:
    cols = result_columns(plan)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(cols)
    for row in rows:
        writer.writerow([csv_cell(row[c]) for c in cols])
    return buf.getvalue()


def parquet_available() -> bool:
    return importlib.util.find_spec("pyarrow") is not None


def results_parquet(plan: SweepPlan, rows: Sequence[dict[str, Any]], path: Path) -> None:
    import pandas as pd

    pd.DataFrame(list(rows), columns=result_columns(plan)).to_parquet(path, index=False, engine="pyarrow")


def holds_limits(s: dict[str, Any]) -> bool:
    """No breaker trip, never over the interconnect limit, never over the ramp limit."""
    return not (s["breaker_trips"] or s["pcc_overlimit_s"] > 0 or s["ramp_violation_s"] > 0)


def short_key(key: str) -> str:
    """`site.storage.bess.energy_mwh` -> `bess energy_mwh`: the last two parts of a key, for labels and answers."""
    parts = key.split(".")
    return " ".join(parts[-2:])


def _where(values: dict[str, Scalar]) -> str:
    ctrl = values.get(CONTROLLER_KEY)
    rest = ", ".join(f"{short_key(k)} = {_fmt_value(v)}" for k, v in values.items() if k != CONTROLLER_KEY)
    if ctrl is not None:
        return f"with {ctrl}" + (f" at {rest}" if rest else "")
    return f"at {rest}" if rest else "in this sweep"


def _violations(s: dict[str, Any]) -> str:
    out = []
    if s["breaker_trips"]:
        out.append(f"{s['breaker_trips']} trip(s)")
    if s["pcc_overlimit_s"] > 0:
        out.append(f"{s['pcc_overlimit_s']:.1f} s over the interconnect limit")
    if s["ramp_violation_s"] > 0:
        out.append(f"{s['ramp_violation_s']:.1f} s over the ramp limit")
    return ", ".join(out)


def answers(plan: SweepPlan, rows: Sequence[dict[str, Any]]) -> list[str]:
    """Plain answers. With a numeric axis (the first one is the size), for every combination of the other axes:
    the smallest size that holds the limits, and the smallest that also loses under GOODPUT_OK_PCT % goodput.
    With none: which controllers hold the limits and which of those loses the least goodput."""
    by_point = {p.run_id: (p, r) for p, r in zip(plan.points, rows, strict=True)}
    numeric = plan.numeric_axes
    if not numeric:
        held = [r for r in rows if holds_limits(r)]
        if not held:
            return ["no run of the grid holds the limits"]
        best = min(held, key=lambda r: r["goodput_loss_power_pct"])
        names = [_where({k: r[k] for k in plan.axes}) for r in held]
        return [
            f"{len(held)} of {len(rows)} runs hold the limits ({'; '.join(names)}); the one that loses the least "
            f"goodput is {_where({k: best[k] for k in plan.axes}).removeprefix('with ')} "
            f"({best['goodput_loss_power_pct']:.2f} %)"
        ]
    size = numeric[0]
    others = sorted((k for k in plan.axes if k != size), key=lambda k: k != CONTROLLER_KEY)
    label = short_key(size)
    lines = []
    for combo in itertools.product(*(plan.axes[k] for k in others)):
        fixed = dict(zip(others, combo, strict=True))
        runs = sorted(
            (
                (float(p.values[size]), r)
                for p, r in by_point.values()
                if all(p.values[k] == v for k, v in fixed.items())
            ),
            key=lambda vr: vr[0],
        )
        ok = [(v, r) for v, r in runs if holds_limits(r)]
        where = _where(fixed)
        if not ok:
            v_max, r_max = runs[-1]
            lines.append(
                f"{where}: no {label} in the grid (up to {v_max:g}) holds the limits "
                f"(at {v_max:g}: {_violations(r_max)})"
            )
            continue
        v0, r0 = ok[0]
        smallest = ", the smallest in the grid" if v0 == runs[0][0] else ""
        text = (
            f"{where}: the smallest {label} that holds the limits is {v0:g}{smallest} "
            f"(goodput lost {r0['goodput_loss_power_pct']:.2f} %)"
        )
        worse = [v for v, r in runs if v > v0 and not holds_limits(r)]
        if worse:
            text += f", though not at {', '.join(f'{v:g}' for v in worse)}"
        cheap = [(v, r) for v, r in ok if r["goodput_loss_power_pct"] < GOODPUT_OK_PCT]
        if cheap and cheap[0][0] != v0:
            v1, r1 = cheap[0]
            text += (
                f"; the smallest that also loses under {GOODPUT_OK_PCT:g} % of goodput is {v1:g} "
                f"({r1['goodput_loss_power_pct']:.2f} %)"
            )
        elif not cheap:
            text += f"; none in the grid holds them losing under {GOODPUT_OK_PCT:g} % of goodput"
        lines.append(text)
    return lines
