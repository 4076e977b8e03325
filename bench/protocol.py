"""The benchmark protocol (issue 20): how every comparison in bench/ is measured and reported.

Rules, kept here once instead of in each scenario:

1. **One measured interval per table.**  A ``Comparison`` is made for one ``Interval`` (say,
   "SIGKILL → the next training step completed"); adding samples that measured another
   interval raises ``ValueError``.  Every method of a table is timed between the same two
   events, with the same warm-up.
2. **n ≥ 3 per cell**, reported as median [min–max] with n (``Cell``).  A headline ratio
   (``Comparison.headline``) refuses a cell with fewer than ``MIN_N`` samples
   (``TooFewSamples``); tables still show such a cell, marked with its n, and its ratio is
   labelled "not a headline".  Every scenario's defaults give n ≥ 3.
3. **The strongest baseline of each mode is named, and every ratio is taken against it**:
   ``strongest(mode)`` is the best median among the methods that are not ours; ratios read
   "how many times better than that one" (> 1: ours is better).
4. **A fault-free throughput row per method** (``throughput_table``): what each method costs
   while nothing fails, next to what it saves when something does.

Stored results are plain JSON; this module reads samples out of them (``samples``), so a
result measured before the protocol renders with its real n.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

MIN_N = 3


class TooFewSamples(ValueError):
    """A headline was asked of a cell with fewer than ``MIN_N`` samples."""


@dataclass(frozen=True)
class Interval:
    """What one sample measures: from ``start`` to ``end`` (both named as events a reader can
    find in the scenario's docstring)."""
    start: str
    end: str

    @property
    def text(self) -> str:
        return f"{self.start} → {self.end}"


@dataclass
class Cell:
    """The samples of one (method, mode) cell."""
    samples: list[float]

    def __post_init__(self) -> None:
        self.samples = [float(x) for x in self.samples if x is not None]
        if not self.samples:
            raise ValueError("a cell needs at least one sample")

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def summary(self) -> dict:
        """``{"median", "min", "max", "n"}``, as result files store a cell."""
        return {"median": self.median, "min": self.min, "max": self.max, "n": self.n}

    def text(self, fmt=None, bold: bool = False, show_n: bool = True) -> str:
        """``1.52 s [1.31–1.86]`` (n ≥ 2) or ``1.52 s (n = 1)`` (``show_n``: a table with an n column
        says it there)."""
        fmt = fmt or _fmt_num
        mid = f"**{fmt(self.median)}**" if bold else fmt(self.median)
        if self.n == 1:
            return f"{mid} (n = 1)" if show_n else mid
        return f"{mid} [{fmt(self.min)}–{fmt(self.max)}]"


@dataclass(frozen=True)
class Ratio:
    """How many times better ``method`` is than ``against`` (> 1: better), from the medians;
    ``lo``/``hi``: the same ratio from the worst and the best pairing of the two cells' ranges."""
    value: float
    lo: float
    hi: float
    method: str
    against: str
    n: int          # the smaller of the two cells' n

    @property
    def headline_ok(self) -> bool:
        return self.n >= MIN_N

    def text(self, against_label: str | None = None, in_table: bool = False) -> str:
        """``3.7× [3.5–3.9] vs torch.save``; below ``MIN_N`` marked "not a headline" (in a table,
        whose note says so once, just its n)."""
        who = f" vs {against_label}" if against_label else ""
        body = f"{_x(self.value)}{who}" if self.n < 2 else f"{_x(self.value)} [{self.lo:.3g}–{self.hi:.3g}]{who}"
        if self.headline_ok:
            return body
        return f"{body} (n = {self.n})" if in_table else f"{body} (n = {self.n}: not a headline)"


@dataclass
class Comparison:
    """One table: methods × modes, all measured over ``interval``.

    ``better``: "lower" (times) or "higher" (throughput, goodput).  ``ours``: the methods that
    are not baselines (a name, or a predicate).  ``labels``: display names."""
    interval: Interval
    better: str = "lower"
    ours: object = "gpu_anchor"
    labels: dict = field(default_factory=dict)
    cells: dict = field(default_factory=dict)       # (method, mode) -> Cell

    def __post_init__(self) -> None:
        if self.better not in ("lower", "higher"):
            raise ValueError(f"better must be 'lower' or 'higher', not {self.better!r}")

    def is_ours(self, method: str) -> bool:
        return self.ours(method) if callable(self.ours) else method == self.ours

    def label(self, method: str) -> str:
        return self.labels.get(method, method)

    def add(self, method: str, mode: str, samples, interval: Interval | None = None) -> Cell:
        if interval is not None and interval != self.interval:
            raise ValueError(f"{method}/{mode} measured {interval.text!r}, but this table measures "
                             f"{self.interval.text!r}: every method must be timed over the same interval")
        cell = samples if isinstance(samples, Cell) else Cell(list(samples))
        self.cells[(method, mode)] = cell
        return cell

    def modes(self) -> list[str]:
        return list(dict.fromkeys(m for _, m in self.cells))

    def methods(self) -> list[str]:
        return list(dict.fromkeys(m for m, _ in self.cells))

    def cell(self, method: str, mode: str) -> Cell | None:
        return self.cells.get((method, mode))

    def _key(self, cell: Cell) -> float:
        return cell.median if self.better == "lower" else -cell.median

    def strongest(self, mode: str) -> tuple[str, Cell] | None:
        """The baseline with the best median in ``mode`` (None without baselines)."""
        base = [(m, c) for (m, md), c in self.cells.items() if md == mode and not self.is_ours(m)]
        return min(base, key=lambda mc: self._key(mc[1])) if base else None

    def ratio(self, method: str, mode: str, against: str | None = None) -> Ratio | None:
        """``method`` against the strongest baseline of ``mode`` (or against ``against``)."""
        me = self.cell(method, mode)
        if against is None:
            best = self.strongest(mode)
            if best is None:
                return None
            against, other = best
        else:
            other = self.cell(against, mode)
        if me is None or other is None or min(me.min, other.min) <= 0:
            return None
        if self.better == "lower":
            v, lo, hi = other.median / me.median, other.min / me.max, other.max / me.min
        else:
            v, lo, hi = me.median / other.median, me.min / other.max, me.max / other.min
        return Ratio(v, lo, hi, method, against, min(me.n, other.n))

    def headline(self, method: str, mode: str) -> Ratio:
        """The ratio a README may quote: against the strongest baseline, both cells n ≥ MIN_N."""
        r = self.ratio(method, mode)
        if r is None:
            raise ValueError(f"no baseline measured in mode {mode!r} to compare {method} with")
        if not r.headline_ok:
            raise TooFewSamples(f"{method} vs {r.against} in {mode}: n = {r.n} < {MIN_N}; not a headline")
        return r

    def ratio_text(self, method: str, mode: str) -> str:
        """The "vs strongest baseline" cell of a table row ("—" for the baselines' own best)."""
        best = self.strongest(mode)
        if best is None:
            return "—"
        if best[0] == method:
            return "strongest"
        r = self.ratio(method, mode)
        return "—" if r is None else r.text(in_table=True)

    def against_strongest(self, method: str, mode: str) -> str | None:
        """``method``'s ratio against the strongest baseline of ``mode``, with that baseline's name."""
        r = self.ratio(method, mode)
        return None if r is None else r.text(self.label(r.against))

    def target_verdict(self, method: str, baseline: str, mode: str, target_x: float, fmt=None) -> str | None:
        """An issue's target set against a named baseline (not necessarily the strongest):
        "mode: A vs B = r× — met / **MISSED**" from the medians, or None if either is missing."""
        me, other = self.cell(method, mode), self.cell(baseline, mode)
        if me is None or other is None:
            return None
        fmt = fmt or _fmt_num
        x = other.median / me.median if self.better == "lower" else me.median / other.median
        return (f"{mode}: {self.label(method)} {fmt(me.median)} vs {self.label(baseline)} {fmt(other.median)} = "
                f"{x:.2f}× — {'met' if x >= target_x else '**MISSED**'}")

    def strongest_line(self, fmt=None) -> str:
        """One sentence naming the strongest baseline of each mode, with its cell."""
        parts = []
        for mode in self.modes():
            best = self.strongest(mode)
            if best is not None:
                parts.append(f"{mode}: {self.label(best[0])} ({best[1].text(fmt)})")
        return ("Strongest baseline per mode (best median; every ratio is taken against it): "
                + "; ".join(parts) + ".") if parts else ""

    def n_note(self) -> str:
        """Says how many samples the cells hold, and flags cells below ``MIN_N``."""
        ns = sorted({c.n for c in self.cells.values()})
        if not ns:
            return ""
        text = f"n = {ns[0]}" if len(ns) == 1 else f"n = {ns[0]}–{ns[-1]}"
        low = [f"{self.label(m)}/{md}" for (m, md), c in self.cells.items() if c.n < MIN_N]
        if low:
            text += (f" per cell; below the protocol's n ≥ {MIN_N} (shown, not headlines): "
                     + ("every cell" if len(low) == len(self.cells) else ", ".join(low) if len(low) <= 6
                        else f"{len(low)} cells"))
        else:
            text += " per cell"
        return f"Measured interval: {self.interval.text}; median [min–max] over {text}."


def from_rows(rows: list[dict], interval: Interval, key: str = "total_s", **kw) -> Comparison:
    """The cells of a recovery table stored as ``[{"method", "modes": {mode: {key, "trials"}}}]``."""
    c = Comparison(interval, **kw)
    for r in rows:
        for mode, x in r["modes"].items():
            v = samples(x, key)
            if v:
                c.add(r["method"], mode, v)
    return c


def samples(x: dict, key: str) -> list[float]:
    """A cell's samples out of a stored result: ``x["trials"][i][key]`` when the result kept its
    trials, else the single stored ``x[key]``."""
    trials = x.get("trials")
    if trials:
        return [t[key] for t in trials if t.get(key) is not None]
    return [x[key]] if x.get(key) is not None else []


def throughput_table(rows: list[tuple[str, Cell | None]], what: str, fmt=None) -> str:
    """The fault-free throughput of every method, one row each: ``rows`` = (label, Cell or None)."""
    lines = [f"| method | fault-free {what} | n |", "| --- | --- | --- |"]
    for label, cell in rows:
        lines.append(f"| {label} | {cell.text(fmt) if cell else 'not measured'} | {cell.n if cell else 0} |")
    return "\n".join(lines)


def throughput_section(rows: list[tuple[str, Cell | None]], intro: str, what: str, fmt=None,
                       missing: str = "") -> list[str]:
    """Markdown lines: ``intro`` and the throughput table, or, for a result stored without the
    fault-free samples, a line that says so (``missing`` adds where else to look)."""
    if any(c for _, c in rows):
        return ["", intro, "", throughput_table(rows, what, fmt)]
    return ["", f"Fault-free {what.split(' (')[0]}: not recorded in this result (measured before the benchmark "
                f"protocol){missing}."]


def _fmt_num(v: float) -> str:
    return f"{v:.3g}"


def _x(v: float) -> str:
    return f"{v:.3g}×" if v < 1e4 else f"{v:.3e}×"
