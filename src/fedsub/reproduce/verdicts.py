"""The verdicts of ``fedsub reproduce``: fedsub's numbers beside the paper's, judged so that a
verdict never claims more than the evidence shows.

Every verdict starts with one word a reader can rely on: **differs** (a claim of the paper
fails on fedsub's runs), **same ranking** / **within** / **holds** (it agrees, within the
stated tolerance), or **not comparable** / **not checked** (the runs cannot say). Rounds to a
target are compared by order and by ratio (the paper's method's speed-up over each baseline,
within ``SPEEDUP_FACTOR`` of the paper's); AUCs and accuracies on an absolute scale
(``POINTS``), the paper's method's margins over the others included; other numbers (losses,
counts) relatively (``WITHIN``). A part's verdict puts a differing judgement first, so its
first word is "differs" whenever one of its checks fails.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

Cell = int | str | None  # rounds to target: a round, "R+" (not reached in R), None (no run)

# A speed-up (rounds of one run over another's) agrees with the paper's when it lies within
# this factor of it either way: FedSubAvg 1.7x faster than FedAvg in the paper agrees with
# 1.2x to 2.55x here.
SPEEDUP_FACTOR = 1.5
# AUCs and accuracies agree when within this many units (0.02: two points of AUC or of
# accuracy); so do the margins of the paper's method over the others.
POINTS = 0.02
# Other numbers (losses, dataset counts) agree when within this fraction of the paper's.
WITHIN = 0.10
# The paper's own method in a table (its speed-ups and margins are the paper's claims):
# FedSubAvg in seeds 000-002, Algorithm 2 (`shuffled`) in seed 003.
OURS = ("fedsubavg", "shuffled")
ROW = tuple[str, str, str]  # (cell, paper, fedsub)


def combine(verdicts: list[str]) -> str:
    """A part's verdict: its judgements, the differing ones first."""
    differing = [v for v in verdicts if v.startswith("differs")]
    rest = [v for v in verdicts if not v.startswith("differs")]
    return "; ".join(differing + rest) or "no numbers to compare (curves written)"


def higher_is_better(metric: str) -> bool:
    return "auc" in metric or "accuracy" in metric


def absolute_scale(metric: str) -> bool:
    """AUCs and accuracies are judged in points, not relative to the paper's value."""
    return higher_is_better(metric)


# --- rounds to a target ------------------------------------------------------------------------


@dataclass(frozen=True)
class Rounds:
    """A cell's rounds to the target: ``reached`` at ``rounds``, or not within ``rounds``
    (the horizon; infinite when the run diverged)."""

    rounds: float
    reached: bool


def parse_cell(cell: Cell) -> Rounds:
    """A round number, "R+" (not reached within R rounds) or "diverged at r"."""
    if isinstance(cell, int):
        return Rounds(float(cell), True)
    if isinstance(cell, str) and cell.endswith("+"):
        return Rounds(float(cell[:-1]), False)
    return Rounds(math.inf, False)


def rank_value(cell: Cell) -> float:
    """A cell's place in a ranking: its round, or infinity when never reached."""
    return float(cell) if isinstance(cell, int) else math.inf


@dataclass(frozen=True)
class Speedup:
    """How many times fewer rounds ``fast`` needs than ``slow``, as an interval: exact when
    both reached, a lower bound when only ``fast`` did, an upper bound when only ``slow``
    did."""

    low: float
    high: float

    def text(self) -> str:
        if self.low == self.high:
            return f"{self.low:.2f}x"
        if math.isinf(self.high):
            return f">{self.low:.2f}x"
        return f"<{self.high:.2f}x"


def speedup(fast: Rounds, slow: Rounds) -> Speedup | None:
    """None when neither reached (nothing is known of the ratio)."""
    if fast.reached and slow.reached:
        ratio = slow.rounds / fast.rounds
        return Speedup(ratio, ratio)
    if fast.reached:
        return Speedup(slow.rounds / fast.rounds, math.inf)
    if slow.reached:
        return Speedup(0.0, slow.rounds / fast.rounds)
    return None


def speedups_agree(paper: Speedup, ours: Speedup, factor: float = SPEEDUP_FACTOR) -> bool:
    """Whether ours can be within ``factor`` of the paper's (intervals widened by it meet)."""
    return ours.low <= paper.high * factor and ours.high >= paper.low / factor


def _speedup_pairs(paper: dict[str, Cell], by_value: bool) -> list[tuple[str, str]]:
    """(fast, slow) pairs whose speed-up the paper claims: the paper's method over each other
    algorithm, or (a sweep of one algorithm) every value over the first."""
    names = list(paper)
    if by_value:
        return [(n, names[0]) for n in names[1:]]
    ours = next((n for n in OURS if n in paper), None)
    return [(ours, n) for n in names if n != ours] if ours else []


def speedup_rows(
    paper: dict[str, Cell], ours: dict[str, Cell], by_value: bool
) -> list[tuple[str, Speedup | None, Speedup | None]]:
    """(label, the paper's speed-up, fedsub's) for every pair the paper claims."""
    rows = []
    for fast, slow in _speedup_pairs(paper, by_value):
        label = f"speed-up of {fast} over {slow}"
        p = speedup(parse_cell(paper[fast]), parse_cell(paper[slow]))
        o = speedup(parse_cell(ours[fast]), parse_cell(ours[slow]))
        rows.append((label, p, o))
    return rows


def rounds_verdict(paper: dict[str, Cell], ours: dict[str, Cell], by_value: bool = False) -> str:
    """Order of the rounds to target (not reached = last), FedSubAvg's speed-up over each
    baseline (``by_value``: each swept value's over the first) against the paper's within
    ``SPEEDUP_FACTOR``, and the cells reached by one side only: none of fedsub's reached where
    the paper's did, or a headline cell (the paper's method; every value of a sweep) reached by
    one side only, is "differs"."""
    if any(c is None for c in ours.values()):
        missing = [n for n, c in ours.items() if c is None]
        return f"not comparable: fedsub ran no {', '.join(missing)}"
    p = {n: parse_cell(c) for n, c in paper.items()}
    o = {n: parse_cell(c) for n, c in ours.items()}
    reasons: list[str] = []
    reversed_, tied = ranking(
        {n: rank_value(c) for n, c in paper.items()}, {n: rank_value(c) for n, c in ours.items()}
    )
    if reversed_:
        reasons.append(_first_of(reversed_))
    if any(r.reached for r in p.values()) and not any(r.reached for r in o.values()):
        reasons.append("the target is reached by none of fedsub's runs (the paper's reach it)")
    headline = set(p) if by_value else {n for n in OURS if n in p}
    one_side = [n for n in p if p[n].reached != o[n].reached]
    for n in one_side:
        if n in headline:
            reasons.append(f"{n} reached {_side(p[n], o[n])}")
    compared = [(label, ps, os) for label, ps, os in speedup_rows(paper, ours, by_value) if ps]
    judged = [(label, ps, os) for label, ps, os in compared if os is not None]
    off = [(label, ps, os) for label, ps, os in judged if not speedups_agree(ps, os)]
    if off:
        label, ps, os = off[0]
        more = f" and {len(off) - 1} more" if len(off) > 1 else ""
        reasons.append(
            f"{label} {os.text()} vs the paper's {ps.text()} (beyond {SPEEDUP_FACTOR:g}x){more}"
        )
    if reasons:
        return "differs: " + "; ".join(reasons)
    parts = [f"same ranking up to ties ({tied[0]})" if tied else "same ranking"]
    if judged:
        parts.append(
            f"speed-ups within {SPEEDUP_FACTOR:g}x of the paper's ("
            + ", ".join(
                f"{label.removeprefix('speed-up of ')} {os.text()} vs {ps.text()}"
                for label, ps, os in judged
            )
            + ")"
        )
    unknown = [label for label, ps, os in compared if os is None]
    if unknown:
        parts.append(f"not checked: {', '.join(unknown)} (neither reached here)")
    others = [n for n in one_side if n not in headline]
    if others:
        parts.append(f"reached by one side only: {', '.join(others)}")
    return ", ".join(parts)


def _side(paper: Rounds, ours: Rounds) -> str:
    if paper.reached:
        return f"in the paper at {paper.rounds:.0f}, not by fedsub in {ours.rounds:.0f} rounds"
    return f"by fedsub at {ours.rounds:.0f}, not in the paper's {paper.rounds:.0f} rounds"


def _first_of(items: list[str]) -> str:
    return items[0] + (f" and {len(items) - 1} more" if len(items) > 1 else "")


# --- rankings ----------------------------------------------------------------------------------


def _order(a: float, b: float) -> int:
    return (a > b) - (a < b)


def ranking(
    paper: dict[str, float], ours: dict[str, float], words: tuple[str, str] = ("before", "after")
) -> tuple[list[str], list[str]]:
    """Pairs the paper orders strictly that fedsub orders the other way (reversals) or ties;
    ``words`` say "lower" and "higher" (rounds: before / after; values: below / above)."""
    reversed_, tied = [], []
    names = [n for n in paper if n in ours]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            want, got = _order(paper[a], paper[b]), _order(ours[a], ours[b])
            if want == 0:
                continue
            first, second = (a, b) if want < 0 else (b, a)
            if got == -want:
                reversed_.append(f"{second} {words[0]} {first} (paper: {words[1]})")
            elif got == 0:
                tied.append(f"{first} ties {second}")
    return reversed_, tied


# --- values (best / final AUC, accuracy, loss) ----------------------------------------------


def relative(ours: float, paper: float) -> float:
    return abs(ours - paper) / abs(paper) if paper else abs(ours - paper)


def gap_text(metric: str, ours: float, paper: float) -> str:
    if absolute_scale(metric):
        return f"{100 * abs(ours - paper):.1f} points"
    return f"{100 * relative(ours, paper):.0f}%"


def _gap(metric: str, ours: float, paper: float) -> float:
    """The gap in the metric's tolerance units: within when at most 1."""
    if absolute_scale(metric):
        return abs(ours - paper) / POINTS
    return relative(ours, paper) / WITHIN


def tolerance_text(metric: str) -> str:
    return f"{100 * POINTS:g} points" if absolute_scale(metric) else f"{100 * WITHIN:g}%"


def margins(values: dict[str, float], metric: str) -> dict[str, float]:
    """The paper's method's lead over each other algorithm (positive: ahead)."""
    ours = next((n for n in OURS if n in values), None)
    if ours is None:
        return {}
    sign = 1.0 if higher_is_better(metric) else -1.0
    return {n: sign * (values[ours] - v) for n, v in values.items() if n != ours}


def values_verdict(
    paper: dict[str, float],
    ours: dict[str, float | None],
    metric: str = "value",
    target: float | None = None,
) -> str:
    """Ranking, the largest gap (points for AUC / accuracy, relative otherwise), the paper's
    method's margins over the others (AUC / accuracy), and the paper's ``target`` missed by an
    algorithm that reached it in the paper."""
    known = {n: v for n, v in ours.items() if v is not None}
    if not known:
        return "not comparable: fedsub has none of these numbers"
    reasons: list[str] = []
    reversed_, tied = ranking(paper, known, ("below", "above"))  # none for a single number
    if reversed_:
        reasons.append(_first_of(reversed_))
    head = f"same ranking up to ties ({tied[0]})" if tied else "same ranking"
    worst = max(known, key=lambda n: _gap(metric, known[n], paper[n]))
    size = (
        f"{worst} {known[worst]:.4g} vs {paper[worst]:.4g} "
        f"({gap_text(metric, known[worst], paper[worst])})"
    )
    if _gap(metric, known[worst], paper[worst]) > 1:
        reasons.append(f"{size}, beyond {tolerance_text(metric)}")
    margin_note = ""
    if absolute_scale(metric):
        theirs, mine = margins(paper, metric), margins(known, metric)
        pairs = [(n, theirs[n], mine[n]) for n in theirs if n in mine]
        off = [(n, t, m) for n, t, m in pairs if abs(m - t) > POINTS]
        if off:
            n, t, m = max(off, key=lambda x: abs(x[2] - x[1]))
            reasons.append(f"margin over {n} {m:+.3f} vs the paper's {t:+.3f}")
        elif pairs:
            margin_note = f"margins within {100 * POINTS:g} points"
    if target is not None:
        missed = [n for n in known if _reaches(paper[n], target, metric)]
        missed = [n for n in missed if not _reaches(known[n], target, metric)]
        if missed:
            reasons.append(
                f"{', '.join(missed)} miss{'es' if len(missed) == 1 else ''} the paper's "
                f"target {metric} {target:g}"
            )
    if reasons:
        return "differs: " + "; ".join(reasons)
    within = f"within {gap_text(metric, known[worst], paper[worst])} ({worst})"
    if len(known) == 1:
        return f"{within}, a single number (nothing ranked)"
    return ", ".join(x for x in (head, within, margin_note) if x)


def _reaches(value: float, target: float, metric: str) -> bool:
    return value >= target if higher_is_better(metric) else value <= target


# --- the shape of a sweep --------------------------------------------------------------------


def shape_verdict(shape: str, cells: dict[str, Cell]) -> str:
    """ "falls then rises": the rounds (not reached: above every reached value) fall to one
    lowest value and rise after it, judged on the values: at least two values reach the
    target, and the fewest rounds are at an interior value with a fall before and a rise
    after."""
    if shape == "any":
        return "not checked: rounds by value reported (the paper claims no shape here)"
    values = [rank_value(c) for c in cells.values()]
    names = list(cells)
    reached = [n for n, v in zip(names, values, strict=True) if math.isfinite(v)]
    if not reached:
        return "differs: the target is reached at no value"
    if len(reached) == 1:
        return (
            f"differs: the target is reached at {reached[0]} only, so no fall and rise are measured"
        )
    best = values.index(min(values))
    if best in (0, len(values) - 1):
        return f"differs: fewest rounds at the {'first' if best == 0 else 'last'} value, no U"
    falls = all(a >= b for a, b in itertools.pairwise(values[: best + 1]))
    rises = all(a <= b for a, b in itertools.pairwise(values[best:]))
    # best is the first lowest and interior: the rounds fell to it; they must rise after it
    if not (falls and rises and values[best] < values[-1]):
        return f"differs: the rounds do not fall to one lowest value then rise ({_cells(cells)})"
    return f"same shape: rounds fall then rise (fewest at {names[best]}: {_cells(cells)})"


def _cells(cells: dict[str, Cell]) -> str:
    return ", ".join(f"{n}: {c}" for n, c in cells.items())


# --- claims ----------------------------------------------------------------------------------


def claim_text(claim: dict) -> str:
    return f"{claim['lower']} below {claim['than']} ({claim['at']} {claim['metric']})"


def claims_verdict(results: list[tuple[str, str]]) -> str:
    """How many of the claims fedsub's runs can check, and whether those hold; the unchecked
    ones are named."""
    checked = [(t, r) for t, r in results if not r.startswith("n/a")]
    unchecked = [t for t, r in results if r.startswith("n/a")]
    failed = [t for t, r in checked if r.startswith("fails")]
    total = len(results)
    if not checked:
        return f"not checked: none of the {total} claims can be checked on these runs"
    left = f"; not checked: {', '.join(unchecked)}" if unchecked else ""
    if failed:
        held = len(checked) - len(failed)
        return (
            f"differs: {failed[0]} fails ({held} of {len(checked)} checked claims hold, "
            f"{total} claims){left}"
        )
    hold = {1: "it holds", 2: "both hold"}.get(len(checked), "all hold")
    return f"{len(checked)} of {total} claims checked, {hold}{left}"


# --- numbers and settings --------------------------------------------------------------------


def number(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def numbers_verdict(rows: list[ROW]) -> str:
    """Dataset statistics: the largest relative gap, within ``WITHIN`` or "differs"."""
    paper = {n: float(p) for n, p, o in rows if o != "n/a"}
    ours = {n: float(o) for n, p, o in rows if o != "n/a"}
    if not paper:
        return "no numbers to compare (plot written)"
    worst = max(paper, key=lambda n: relative(ours[n], paper[n]))
    gap = relative(ours[worst], paper[worst])
    if gap <= WITHIN:
        return f"within {100 * gap:.0f}%"
    return f"differs: {worst} {ours[worst]:.6g} vs {paper[worst]:.6g} ({100 * gap:.0f}% off)"


def settings_verdict(rows: list[ROW]) -> str:
    wrong = [r for r in rows if not _same_setting(r[1], r[2])]
    if not wrong:
        return f"same settings ({len(rows)} of {len(rows)})"
    cell, paper, ours = wrong[0]
    matching = len(rows) - len(wrong)
    return f"differs: {cell} is {ours}, the paper's {paper} ({matching} of {len(rows)} match)"


def _same_setting(paper: str, ours: str) -> bool:
    try:
        return math.isclose(float(paper), float(ours), rel_tol=1e-9)
    except ValueError:
        return paper == ours


# --- a part's runs against the paper's numbers -----------------------------------------------


def fedsub_cell(entry: dict | None, horizon: int) -> Cell:
    """A run's rounds to the target: the round, "R+" or "diverged at r"; None: no run."""
    if entry is None:
        return None
    if entry.get("diverged"):
        return f"diverged at {entry['diverged']['round']}"
    reached = entry.get("rounds_to_target")
    return reached if reached is not None else f"{horizon}+"


def metric_value(entry: dict | None, at: str, metric: str) -> float | None:
    """A run's ``at`` ("best", "final") value of ``metric`` (``abs_X``: |X|); None if absent."""
    if entry is None:
        return None
    absolute = metric.startswith("abs_")
    value = entry.get(at, {}).get(metric.removeprefix("abs_"))
    if value is None or not math.isfinite(value):
        return None
    return abs(value) if absolute else float(value)


def claim_result(claim: dict, table: dict[str, dict], horizon: int) -> tuple[str, str]:
    """(the claim, "holds (x vs y)" / "fails (...)" / "n/a (why)")."""
    lower, than, metric, at = claim["lower"], claim["than"], claim["metric"], claim["at"]
    text = claim_text(claim)
    if at == "rounds":
        a = fedsub_cell(table.get(lower), horizon)
        b = fedsub_cell(table.get(than), horizon)
        if a is None or b is None:
            return text, "n/a (not run)"
        if not (isinstance(a, int) or isinstance(b, int)):
            return text, f"n/a (neither reached the target: {a} vs {b})"
        holds = rank_value(a) < rank_value(b)
        return text, f"{'holds' if holds else 'fails'} ({a} vs {b})"
    x, y = metric_value(table.get(lower), at, metric), metric_value(table.get(than), at, metric)
    if x is None or y is None:
        return text, "n/a (not run)"
    return text, f"{'holds' if x < y else 'fails'} ({x:.4g} vs {y:.4g})"


def judge(paper: dict[str, Any], table: dict[str, dict], horizon: int) -> tuple[list[ROW], str]:
    """Rows (cell, paper, fedsub) and the verdict for every kind of number the paper gives."""
    rows: list[ROW] = []
    verdicts: list[str] = []
    for kind in ("rounds_to_target", "rounds_by_value"):
        if kind in paper:
            by_value = kind == "rounds_by_value"
            cells = {n: fedsub_cell(table.get(n), horizon) for n in paper[kind]}
            rows += [
                (f"rounds to target: {n}", str(p), str(cells[n])) for n, p in paper[kind].items()
            ]
            if all(c is not None for c in cells.values()):
                rows += [
                    (label, p.text() if p else "?", o.text() if o else "?")
                    for label, p, o in speedup_rows(paper[kind], cells, by_value)
                ]
            verdicts.append(rounds_verdict(paper[kind], cells, by_value))
    targets = paper.get("target", {})
    for at in ("best", "final"):
        for metric, by_name in paper.get(at, {}).items():
            ours = {n: metric_value(table.get(n), at, metric) for n in by_name}
            rows += [
                (f"{at} {metric}: {n}", number(p), number(ours[n])) for n, p in by_name.items()
            ]
            if absolute_scale(metric):
                theirs, mine = (
                    margins(by_name, metric),
                    margins({n: v for n, v in ours.items() if v is not None}, metric),
                )
                rows += [
                    (f"{at} {metric}: margin over {n}", f"{t:+.4g}", number(mine.get(n)))
                    for n, t in theirs.items()
                ]
            target = targets.get(metric) if at == "best" else None
            verdicts.append(values_verdict(by_name, ours, metric, target))
    for metric, value in paper.get("lowest", {}).items():
        values = [metric_value(entry, "best", metric) for entry in table.values()]
        lowest = min((v for v in values if v is not None), default=None)
        rows.append((f"lowest {metric} over the runs", number(value), number(lowest)))
        verdicts.append(values_verdict({"lowest": value}, {"lowest": lowest}, metric))
    shape = paper.get("rounds_shape")
    if shape is not None:
        cells = {n: fedsub_cell(entry, horizon) for n, entry in table.items()}
        rows += [(f"rounds to target at {n}", "", str(c)) for n, c in cells.items()]
        verdicts.append(shape_verdict(shape, cells))
    claims = paper.get("claims")
    if claims:
        results = [claim_result(c, table, horizon) for c in claims]
        rows += [(text, "holds", outcome) for text, outcome in results]
        verdicts.append(claims_verdict(results))
    return rows, combine(verdicts)
