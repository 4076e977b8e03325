"""README's figures, checked against the results they come from (issue 20).

Every measured figure README.md quotes is followed, right after the clause that states it, by
a marker naming the result file and the value of each number in that clause:

    mapped memory copies as fast as native (H200: 4247 vs 4253 GB/s<!-- fig daemon_mapping:
    bandwidth_mapped_gbs, bandwidth_native_gbs -->)

- ``fig NAME[ PREFIX]: EXPR, EXPR, ...`` — ``bench/results/NAME.json``.  The marker binds every
  number between the previous marker (or the start of the paragraph or list item) and itself,
  in order, one ``EXPR`` each; ``_`` skips a number that is not a measurement (a model size, a
  count of requests; a sample count written ``n = 3`` is skipped by itself).  ``EXPR`` is a
  path into the JSON — keys joined by ``.``, ``[key]`` for a key with dots, dashes or commas, ``[3]``
  for a list index, ``[field=value]`` for the list element whose field has that value —
  combined with other paths or numbers by ``+ - * /``, spaces around each, evaluated left to
  right without precedence (``a / b``, ``x * 1000`` for milliseconds, ``a - b / a * 100`` for
  "b is that many % below a").  ``@OTHER PATH`` takes one number from
  ``bench/results/OTHER.json`` instead (no prefix).  A path starting with ``.`` or ``[``
  continues ``PREFIX``.  ``median(TERM; TERM; ...)`` is the median of its terms, each an
  ``EXPR`` or an ``@OTHER PATH`` (the median of runs stored one file each); ``min(...)`` and
  ``max(...)`` alike.
- ``fig none: WHY`` — the clause's numbers are not benchmark results (a paper's figure, a
  test's running time); says why.

A number matches when the value, rounded to the digits the README shows, is that number
(|value − shown| ≤ half a unit of the last digit shown).  A figure — a number with a unit of
measure (s, ms, µs, GB/s, tokens/s, %, ×, MiB, GiB, GB) — outside every marked clause is an
error: README quotes no figure without its source.

    python -m bench figures            # every marker: README's numbers, the JSON's values
    python -m bench figures --check    # exit 1 on any mismatch or unsourced figure (the CPU test)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from dataclasses import dataclass

from bench.common import RESULTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")

MARKER = re.compile(r"<!--\s*fig\s+(.*?)-->", re.S)
NUMBER = re.compile(r"(?<![\w.#/'\-])(\d{1,3}(?: \d{3})+(?![\d.])|\d+(?:\.\d+)?(?:e-?\d+)?)(?![\w.\-])")
UNIT = re.compile(r"\s?(?:ms|µs|s|GB/s|TB/s|tokens/s|MiB|GiB|GB)(?![\w/])|\s?%(?!/)|×")
BOUNDARY = re.compile(r"\n\s*\n|\n\s*[-*] |\n#+ ")   # where a paragraph or a list item starts
SAMPLE_COUNT = re.compile(r"\bn = $")                     # "(n = 3)": how many samples, not a figure


class FigureError(ValueError):
    pass


@dataclass
class Bound:
    line: int
    shown: str
    expr: str
    value: float | None
    problem: str | None


def _strip_code(text: str) -> str:
    """Code blocks and inline code blanked out (same length: line numbers stay right)."""
    text = re.sub(r"```.*?```", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)
    return re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group()), text)


def _lookup(data, path: str):
    pos, cur = 0, data
    tokens = re.findall(r"\[[^\]]*\]|\.?[^.\[\]]+", path)
    if "".join(tokens) != path:
        raise FigureError(f"cannot read the path {path!r}")
    for tok in tokens:
        pos += len(tok)
        if tok.startswith("["):
            inner = tok[1:-1]
            if "=" in inner and isinstance(cur, list):
                field, want = inner.split("=", 1)
                hit = [x for x in cur if isinstance(x, dict) and str(x.get(field)) == want]
                if not hit:
                    raise FigureError(f"{path}: no element with {field} = {want}")
                cur = hit[0]
                continue
            key = int(inner) if inner.isdigit() and isinstance(cur, list) else inner
        else:
            key = tok.lstrip(".")
            key = int(key) if key.isdigit() and isinstance(cur, list) else key
        try:
            cur = cur[key]
        except (KeyError, IndexError, TypeError):
            raise FigureError(f"{path}: no {key!r} at {path[:pos]!r}") from None
    if isinstance(cur, bool) or not isinstance(cur, (int, float)):
        raise FigureError(f"{path}: {cur!r} is not a number")
    return float(cur)


def evaluate(data: dict, expr: str, prefix: str = "") -> float:
    """``path``, ``path / path``, ``path * 1000``, ``a - b / a * 100``: operands and ``+ - * /``
    (spaces around each operator), evaluated left to right without precedence."""
    parts = _split_operators(expr.strip())
    value = None
    for i in range(0, len(parts), 2):
        term = parts[i]
        if re.fullmatch(r"-?\d+(\.\d+)?(e-?\d+)?", term):
            x = float(term)
        else:
            x = _lookup(data, prefix + term if term[:1] in ".[" else term)
        if value is None:
            value = x
        elif parts[i - 1] == "*":
            value *= x
        elif parts[i - 1] == "+":
            value += x
        elif parts[i - 1] == "-":
            value -= x
        else:
            if x == 0:
                raise FigureError(f"{expr}: division by zero")
            value /= x
    return value


def _split_operators(expr: str) -> list[str]:
    """``re.split`` at `` + - * / `` outside brackets: a key in ``[...]`` may hold `` + ``."""
    parts, depth, last = [], 0, 0
    for m in re.finditer(r"[\[\]]|\s+([-+*/])\s+", expr):
        if m.group(0) == "[":
            depth += 1
        elif m.group(0) == "]":
            depth -= 1
        elif depth == 0:
            parts += [expr[last:m.start()], m.group(1)]
            last = m.end()
    return parts + [expr[last:]]


def _matches(shown: str, value: float) -> bool:
    digits = shown.replace(" ", "")
    decimals = len(digits.split(".")[1]) if "." in digits and "e" not in digits else 0
    if "e" in digits:
        mant = digits.split("e")[0]
        decimals = (len(mant.split(".")[1]) if "." in mant else 0) - int(digits.split("e")[1])
    return abs(value - float(digits)) <= 0.5 * 10 ** -decimals + 1e-9


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def check(path: str = README, results: str = RESULTS) -> tuple[list[Bound], list[str]]:
    """Every bound number with its value, and the problems (mismatches, unreadable markers,
    unsourced figures)."""
    with open(path) as f:
        raw = f.read()
    text = _strip_code(raw)
    bounds: list[Bound] = []
    problems: list[str] = []
    covered: list[tuple[int, int]] = []
    cache: dict[str, dict] = {}
    starts = [0] + [m.end() for m in BOUNDARY.finditer(text)]
    prev_end = 0
    for m in MARKER.finditer(text):
        start = max([s for s in starts if s <= m.start()] + [prev_end])
        covered.append((start, m.start()))
        prev_end = m.end()
        span = MARKER.sub(lambda x: " " * len(x.group()), text[start:m.start()])
        nums = [(start + n.start(), n.group()) for n in NUMBER.finditer(span)
                if not SAMPLE_COUNT.search(span[max(0, n.start() - 8):n.start()])]
        head, sep, body = m.group(1).partition(":")
        where = f"{os.path.basename(path)}:{_line(text, m.start())}"
        if not sep:
            problems.append(f"{where}: marker without ':' ({m.group().strip()})")
            continue
        source, _, prefix = head.strip().partition(" ")
        if source == "none":
            continue
        exprs = [" ".join(e.split()) for e in re.split(r",(?![^\[\]]*\])", body)]   # not a comma inside [key]
        if len(exprs) != len(nums):
            problems.append(f"{where}: {len(nums)} number(s) {[n for _, n in nums]} before the marker, "
                            f"{len(exprs)} expression(s)")
            continue
        for (pos, shown), expr in zip(nums, exprs):
            if expr == "_":
                continue
            name = source
            try:
                name, value = value_of(expr, source, prefix.strip(), results, cache)
                bad = None if _matches(shown, value) else f"README says {shown}, {name}.json gives {value:.6g}"
            except (OSError, ValueError, statistics.StatisticsError) as e:  # FigureError is a ValueError
                value, bad = None, f"{name}: {e}"
            bounds.append(Bound(_line(text, pos), shown, f"{name}: {expr}", value, bad))
            if bad:
                problems.append(f"{os.path.basename(path)}:{_line(text, pos)}: {bad} ({expr})")
    for n in NUMBER.finditer(text):
        if UNIT.match(text, n.end()) and not any(a <= n.start() < b for a, b in covered):
            problems.append(f"{os.path.basename(path)}:{_line(text, n.start())}: figure "
                            f"{text[n.start():n.end() + 8].split(chr(10))[0]!r} has no source marker")
    return bounds, problems


AGGREGATES = {"median": statistics.median, "min": min, "max": max}


def value_of(expr: str, source: str, prefix: str, results: str, cache: dict) -> tuple[str, float]:
    """``(file, value)`` of one ``EXPR`` of ``source``: a term, or ``median(TERM; ...)``
    (``min``, ``max`` alike) over terms of this file or ``@OTHER`` files."""
    agg, _, rest = expr.partition("(")
    if agg in AGGREGATES and rest.endswith(")"):
        return source, AGGREGATES[agg]([_term(t.strip(), source, prefix, results, cache)[1]
                                        for t in rest[:-1].split(";")])
    return _term(expr, source, prefix, results, cache)


def _term(expr: str, source: str, prefix: str, results: str, cache: dict) -> tuple[str, float]:
    """``(file, value)`` of one ``EXPR`` of ``source`` (or ``@OTHER PATH``)."""
    name, pre = source, prefix
    if expr.startswith("@"):          # this number comes from another result file
        name, _, expr = expr[1:].partition(" ")   # whitespace is single spaces by now
        pre = ""
    if name not in cache:
        with open(os.path.join(results, name + ".json")) as f:
            cache[name] = json.load(f)
    return name, evaluate(cache[name], expr, pre)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench figures", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--readme", default=README)
    p.add_argument("--results", default=RESULTS)
    p.add_argument("--check", action="store_true", help="exit 1 on any problem")
    a = p.parse_args(argv)
    bounds, problems = check(a.readme, a.results)
    for b in bounds:
        print(f"{'ok ' if not b.problem else 'BAD'} line {b.line:4d}: {b.shown:>10} "
              f"{'' if b.value is None else f'= {b.value:.6g}'}  [{b.expr}]")
    for msg in problems:
        print("PROBLEM", msg)
    print(f"{len(bounds)} figures checked, {len(problems)} problem(s)")
    return 1 if problems and a.check else 0
