"""``python -m hipkern.tune report <op>``: per tuned shape, the chosen candidate, its time, the
heuristic default's time and the gain; then geometric means over the shapes, against the default and
against the best single fixed variant (every variant with its default parameters)."""
from __future__ import annotations

import math

from .core import _load, candidate_of, candidates_path, row_key


def _geomean(xs) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def report_rows(adapter, out) -> list:
    """One dict per database row: shape, chosen, us, tbps, the schema's measures (the chosen row's),
    default, default_us, gain, <variant>_us."""
    schema = adapter.schema
    db = _load(schema, out)
    if not db:
        raise ValueError(f"report: {out} has no tuned rows (run python -m hipkern.tune {adapter.op} first)")
    ok = {(row_key(schema, r), candidate_of(schema, r).name): float(r["us"])
          for r in _load(schema, candidates_path(out)) if r.get("status") == "ok"}
    rows = []
    for r in db:
        key, shape = row_key(schema, r), adapter.parse_shape(r)
        info = adapter.info_for(r["arch"], int(r["cu_count"]))
        pruned = adapter.candidates(shape, info)
        same, offered = pruned.same, {c.name for c in pruned.kept} | set(pruned.same) | set(pruned.dominated)
        timed = lambda name: ok.get((key, same.get(name, name)))  # noqa: E731 (a launch timed under its first name)
        us, default = float(r["us"]), adapter.heuristic(shape, info).name
        d_us = timed(default)
        rows.append({"device": r.get("device") or "any", "shape": adapter.describe(shape),
                     "chosen": candidate_of(schema, r).name, "us": us,
                     "tbps": float(r["tbps"]) if r.get("tbps") else math.nan,
                     **{m: float(r[m]) if r.get(m) else None for m in schema.measures},
                     "default": default, "default_us": d_us,
                     "gain": d_us / us if d_us else None,
                     **{f"{v}_us": timed(v) for v in sorted(schema.variants)},
                     **{f"{v}_offered": v in offered for v in sorted(schema.variants)}})
    return rows


def _summary(adapter, rows, prefix: str) -> list:
    """The geometric-mean lines of one GPU's rows."""
    lines = []
    gains = [r["gain"] for r in rows if r["gain"]]
    if gains:
        defaults = {r["default"] for r in rows}
        what = defaults.pop() if len(defaults) == 1 else "the heuristic default per shape"
        lines.append(f"tuned vs the default ({what}): geometric-mean gain {_geomean(gains):.3f}x over "
                     f"{len(gains)} of {len(rows)} shapes (min {min(gains):.3f}x, max {max(gains):.3f}x)")
    fixed = {}
    for v in sorted(adapter.schema.variants):
        times = [r[f"{v}_us"] for r in rows]
        if not any(r[f"{v}_offered"] for r in rows):  # always takes parameters (fused_moe's block_m)
            continue
        if all(times):
            fixed[v] = _geomean([t / r["us"] for t, r in zip(times, rows)])
        else:
            lines.append(f"{v} with its defaults has no accepted time on {sum(not t for t in times)} shapes")
    if fixed:
        best = min(fixed, key=fixed.get)
        lines.append(f"tuned vs the best single fixed variant ({best}): geometric-mean gain {fixed[best]:.3f}x over "
                     f"{len(rows)} shapes; " + ", ".join(f"{v} {g:.3f}x" for v, g in sorted(fixed.items())))
    return [prefix + line for line in lines]


def report(adapter, out) -> str:
    rows = report_rows(adapter, out)
    devices = len({r["device"] for r in rows}) > 1  # GPUs of one arch and CU count keep their own rows
    head = ["device"] * devices + ["shape", "chosen", "us", "tbps", *adapter.schema.measures, "default", "default_us",
                                   "gain"]
    cell = lambda v: "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    table = [head] + [[cell(r[c]) for c in head] for r in rows]
    widths = [max(len(t[c]) for t in table) for c in range(len(head))]
    lines = ["  ".join(t[c].ljust(widths[c]) if c < 2 + devices else t[c].rjust(widths[c]) for c in range(len(head)))
             for t in table]
    for dev in sorted({r["device"] for r in rows}):
        lines += _summary(adapter, [r for r in rows if r["device"] == dev], f"{dev}: " if devices else "")
    return "\n".join(lines)
