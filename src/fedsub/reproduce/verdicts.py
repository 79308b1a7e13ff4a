"""The verdicts of ``fedsub reproduce``: fedsub's numbers beside the paper's, judged so that a
verdict never claims more than the evidence shows.

Every verdict starts with one word a reader can rely on: **differs** (a claim of the paper
fails on fedsub's runs), **same ranking** / **within** / **holds** (it agrees, within the
stated tolerance), or **not comparable** / **not checked** (the runs cannot say: a number
missing or not finite, a bound against a bound). Rounds to a target are compared by order, by
the paper's method's own rounds (``ROUNDS_FACTOR``) and by the size of its speed-up over each
baseline (the log of the ratio within ``SPEEDUP_FACTOR`` of the paper's, widened by
``SPEEDUP_SLACK``); AUCs and accuracies on an absolute scale (``POINTS``), the paper's
method's margins over the others included; other numbers (losses, counts) relatively
(``WITHIN``). A part's verdict puts a differing judgement first, so its first word is
"differs" whenever one of its checks fails; ``judge_all`` also gives every claim as a line of
its own (``Check``: holds, differs or not checked).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

Cell = int | str | None  # rounds to target: a round, "R+" (not reached in R rounds), None (no run)

# A speed-up (rounds of one run over another's) agrees with the paper's when its size, the
# log of the speed-up (how far from 1 it is), is within this factor of the paper's either way,
# widened by SPEEDUP_SLACK: the paper's 1.7x agrees with 1.29x to 2.44x, and 1.7x shrunk to
# 1.14x (most of the effect lost) differs. A speed-up near 1 agrees within the slack alone.
SPEEDUP_FACTOR = 1.5
# Rounds 10% apart either way are one evaluation or a little noise apart (e.g. 100 vs 110).
SPEEDUP_SLACK = 1.1
# The paper's method's own rounds (FedSubAvg at 190 against the paper's 53) agree when within
# this factor of the paper's either way.
ROUNDS_FACTOR = 1.5
# AUCs and accuracies agree when within this many units (0.02: two points of AUC or of
# accuracy); so do the margins of the paper's method over the others.
POINTS = 0.02
# Other numbers (losses, dataset counts) agree when within this fraction of the paper's.
WITHIN = 0.10
# A tolerance is met up to float rounding (0.641 - 0.621 is 0.02000000000000002).
ROUNDING = 1e-9
# The paper's own method in a table (its speed-ups and margins are the paper's claims):
# FedSubAvg in seeds 000-002, Algorithm 2 (`shuffled`) in seed 003.
OURS = ("fedsubavg", "shuffled")
ROW = tuple[str, str, str]  # (cell, paper, fedsub)


@dataclass(frozen=True)
class Check:
    """One claim of the paper judged on fedsub's runs: ``outcome`` "holds", "differs" or
    "not checked", ``text`` what was compared (one line of the report)."""

    outcome: str
    text: str
    claim: str = ""  # the claim without fedsub's numbers (the same on every seed); "": text

    @property
    def key(self) -> str:
        return self.claim or self.text

    def line(self) -> str:
        return f"{self.outcome}: {self.text}"


def combine(verdicts: list[str]) -> str:
    """A part's verdict: its judgements, the differing ones first, then the ones that cannot
    be compared, then the rest."""
    differing = [v for v in verdicts if v.startswith("differs")]
    unknown = [v for v in verdicts if v.startswith("not comparable")]
    rest = [v for v in verdicts if v not in differing and v not in unknown]
    return "; ".join(differing + unknown + rest) or "no numbers to compare (curves written)"


def higher_is_better(metric: str) -> bool:
    return "auc" in metric or "accuracy" in metric


def absolute_scale(metric: str) -> bool:
    """AUCs and accuracies are judged in points, not relative to the paper's value."""
    return higher_is_better(metric)


def distinct(a: float, b: float, digits: int = 4) -> tuple[str, str]:
    """``a`` and ``b`` printed with ``digits`` significant digits, or more until they read
    differently when they differ (a claim decided by 1e-5 never reads "0.26 vs 0.26")."""
    for d in range(digits, 18):
        x, y = f"{a:.{d}g}", f"{b:.{d}g}"
        if x != y or a == b:
            return x, y
    return repr(a), repr(b)


# --- rounds to a target ------------------------------------------------------------------------


@dataclass(frozen=True)
class Rounds:
    """A cell's rounds to the target: ``reached`` at ``rounds``, or not within ``rounds``
    (the horizon); a diverged run never reaches (``rounds`` infinite, ``diverged`` its
    round)."""

    rounds: float
    reached: bool
    diverged: int | None = None

    def text(self) -> str:
        if self.diverged is not None:
            return f"diverged at round {self.diverged}"
        if self.reached:
            return f"at {self.rounds:.0f}"
        return f"not in {self.rounds:.0f} rounds"


def parse_cell(cell: Cell) -> Rounds:
    """A round number, "R+" (not reached within R rounds) or "diverged at r"."""
    if isinstance(cell, int):
        return Rounds(float(cell), True)
    if isinstance(cell, str) and cell.endswith("+"):
        return Rounds(float(cell[:-1]), False)
    if isinstance(cell, str) and cell.startswith("diverged at "):
        return Rounds(math.inf, False, int(cell.removeprefix("diverged at ")))
    return Rounds(math.inf, False)


def rank_value(cell: Cell) -> float:
    """A cell's place in a ranking: its round, or infinity when never reached."""
    return float(cell) if isinstance(cell, int) else math.inf


@dataclass(frozen=True)
class Speedup:
    """How many times fewer rounds ``fast`` needs than ``slow``, as an interval: exact when
    both reached, a lower bound when only ``fast`` did, an upper bound when only ``slow``
    did (0 when ``fast`` diverged: it never reaches)."""

    low: float
    high: float

    @property
    def exact(self) -> bool:
        return self.low == self.high

    def text(self) -> str:
        if math.isinf(self.low):
            return "unbounded (reached at round 0)"
        if self.exact:
            return "none (never reaches)" if self.low == 0 else f"{self.low:.2f}x"
        if math.isinf(self.high):
            return f">{self.low:.2f}x"
        if self.high == 0:
            return "none (never reaches)"
        return f"<{self.high:.2f}x"


def speedup(fast: Rounds, slow: Rounds) -> Speedup | None:
    """None when neither reached (nothing is known of the ratio). A run that meets the
    target at round 0 (its initial model) is infinitely faster than one that needs rounds,
    and as fast as another at round 0."""
    if fast.reached and slow.reached:
        ratio = _ratio(slow.rounds, fast.rounds)
        return Speedup(ratio, ratio)
    if fast.reached:
        return Speedup(_ratio(slow.rounds, fast.rounds), math.inf)
    if slow.reached:
        return Speedup(0.0, _ratio(slow.rounds, fast.rounds))
    return None


def _ratio(slow: float, fast: float) -> float:
    if fast == 0:
        return 1.0 if slow == 0 else math.inf
    return slow / fast


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def agreeing_band(paper: Speedup, factor: float = SPEEDUP_FACTOR) -> tuple[float, float]:
    """The speed-ups that agree with the paper's: its size (the log) within ``factor`` either
    way, widened by ``SPEEDUP_SLACK``; a bound of the paper's stays open on its side."""
    low, high = _log(paper.low), _log(paper.high)
    slack = math.log(SPEEDUP_SLACK)
    lo = min(low / factor, low * factor) if math.isfinite(low) else low
    hi = max(high / factor, high * factor) if math.isfinite(high) else high
    return math.exp(lo - slack), math.exp(hi + slack)


def speedup_outcome(paper: Speedup, ours: Speedup, factor: float = SPEEDUP_FACTOR) -> str:
    """ "holds" when fedsub's speed-up is exact and inside the band that agrees with the
    paper's (a bound of the paper's is its claim: "at least 3.85x"); "differs" when fedsub's
    (exact or a bound) lies wholly outside it; "not checked" when fedsub's is a bound that
    meets the band (a bound against a bound, or against the paper's number, shows nothing)."""
    lo, hi = agreeing_band(paper, factor)
    tol = 1 + ROUNDING
    if ours.high * tol < lo or ours.low > hi * tol:
        return "differs"
    return "holds" if ours.exact else "not checked"


def speedups_agree(paper: Speedup, ours: Speedup, factor: float = SPEEDUP_FACTOR) -> bool:
    """Whether fedsub's speed-up shows the paper's (``speedup_outcome`` "holds")."""
    return speedup_outcome(paper, ours, factor) == "holds"


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
    """(label, the paper's speed-up, fedsub's) for every pair the paper claims (fedsub's None
    when a side was not run or neither reached)."""
    rows = []
    for fast, slow in _speedup_pairs(paper, by_value):
        label = f"speed-up of {fast} over {slow}"
        p = speedup(parse_cell(paper[fast]), parse_cell(paper[slow]))
        a, b = ours.get(fast), ours.get(slow)
        o = None if a is None or b is None else speedup(parse_cell(a), parse_cell(b))
        rows.append((label, p, o))
    return rows


def _own_rounds(name: str, paper: Rounds, ours: Rounds) -> Check:
    """The paper's method's own cell: its rounds within ``ROUNDS_FACTOR`` of the paper's."""
    claim = f"{name}'s own rounds"
    what = f"{claim}, fedsub {ours.text()} vs the paper's {paper.text()}"
    if paper.reached != ours.reached:
        return Check("differs", what, claim)
    if not paper.reached:
        return Check("not checked", f"{what} (neither reached)", claim)
    ratio = _ratio(ours.rounds, paper.rounds)
    inside = ratio * (1 + ROUNDING) >= 1 / ROUNDS_FACTOR and ratio <= ROUNDS_FACTOR * (1 + ROUNDING)
    return Check(
        "holds" if inside else "differs",
        f"{what} ({ratio:.2f}x, {'within' if inside else 'beyond'} {ROUNDS_FACTOR:g}x)",
        claim,
    )


def rounds_checks(
    paper: dict[str, Cell], ours: dict[str, Cell], by_value: bool
) -> tuple[str, list[Check]]:
    """``rounds_verdict`` and its checks, one per claim."""
    missing = [n for n in paper if ours.get(n) is None]
    present = [n for n in paper if n not in missing]
    p = {n: parse_cell(paper[n]) for n in paper}
    o = {n: parse_cell(ours[n]) for n in present}
    reasons, checks, tied = _order_checks(paper, ours, present)
    if (
        not missing
        and any(r.reached for r in p.values())
        and not any(r.reached for r in o.values())
    ):
        reasons.append("the target is reached by none of fedsub's runs (the paper's reach it)")
    headline = set(p) if by_value else {n for n in OURS if n in p}
    one_side = [n for n in present if p[n].reached != o[n].reached]
    for n in one_side:
        if n in headline:
            reasons.append(f"{n} reached {_side(p[n], o[n])}")
    own = {n: _own_rounds(n, p[n], o[n]) for n in p if n in headline and n in o}
    checks += own.values()
    reasons += [c.text for n, c in own.items() if c.outcome == "differs" and n not in one_side]
    outcomes = _speedup_outcomes(paper, ours, by_value)
    checks += _speedup_checks(outcomes, reasons)
    not_run = f"fedsub ran no {', '.join(missing)}"
    if missing:
        checks.append(Check("not checked", f"{', '.join(missing)}: not run here"))
    if reasons:
        return "differs: " + "; ".join(reasons) + (
            f"; not comparable: {not_run}" if missing else ""
        ), checks
    if missing:
        return f"not comparable: {not_run}", checks
    others = [n for n in one_side if n not in headline]
    return _agreeing(tied, outcomes, own, p, o, others), checks


Outcomes = list[tuple[str, Speedup, Speedup | None, str]]


def _order_checks(
    paper: dict[str, Cell], ours: dict[str, Cell], present: list[str]
) -> tuple[list[str], list[Check], list[str]]:
    """The algorithms' order, ours against the paper's: the reason it differs (if it does),
    its checks and the ties ``ranking`` found."""
    reasons: list[str] = []
    reversed_, tied = ranking(
        {n: rank_value(paper[n]) for n in present}, {n: rank_value(ours[n]) for n in present}
    )
    if reversed_:
        reasons.append(_first_of(reversed_))
    checks = [Check("differs", f"order: {r}", "order") for r in reversed_]
    if len(present) > 1 and not reversed_:
        checks.append(
            Check(
                "holds",
                "order of " + ", ".join(present) + (f" ({tied[0]})" if tied else ""),
                "order",
            )
        )
    return reasons, checks, tied


def _speedup_checks(outcomes: Outcomes, reasons: list[str]) -> list[Check]:
    """One check per speed-up; the first that differs beyond ``SPEEDUP_FACTOR`` (and how many
    more do) joins ``reasons``."""
    checks = []
    for label, ps, os, outcome in outcomes:
        got = os.text() if os else "unknown (neither reached here, or not run)"
        checks.append(Check(outcome, f"{label} {got} vs the paper's {ps.text()}", label))
    off = [(label, ps, os) for label, ps, os, outcome in outcomes if os and outcome == "differs"]
    if off:
        label, ps, os = off[0]
        more = f" and {len(off) - 1} more" if len(off) > 1 else ""
        reasons.append(
            f"{label} {os.text()} vs the paper's {ps.text()} (its size beyond "
            f"{SPEEDUP_FACTOR:g}x){more}"
        )
    return checks


def _speedup_outcomes(paper: dict[str, Cell], ours: dict[str, Cell], by_value: bool) -> Outcomes:
    """(label, the paper's speed-up, fedsub's, its outcome) for every pair the paper gives a
    speed-up for (neither reached in the paper: nothing to compare)."""
    return [
        (label, ps, os, speedup_outcome(ps, os) if os else "not checked")
        for label, ps, os in speedup_rows(paper, ours, by_value)
        if ps
    ]


def _agreeing(
    tied: list[str],
    outcomes: Outcomes,
    own: dict[str, Check],
    p: dict[str, Rounds],
    o: dict[str, Rounds],
    others: list[str],
) -> str:
    """A rounds verdict where nothing differs: what holds, then what was not checked."""
    parts = [f"same ranking up to ties ({tied[0]})" if tied else "same ranking"]
    held = [(label, ps, os) for label, ps, os, outcome in outcomes if os and outcome == "holds"]
    if held:
        parts.append(
            f"speed-ups within {SPEEDUP_FACTOR:g}x of the paper's in size ("
            + ", ".join(
                f"{label.removeprefix('speed-up of ')} {os.text()} vs {ps.text()}"
                for label, ps, os in held
            )
            + ")"
        )
    own_held = [n for n, c in own.items() if c.outcome == "holds"]
    if own_held:
        parts.append(
            f"own rounds within {ROUNDS_FACTOR:g}x of the paper's ("
            + ", ".join(f"{n} {o[n].rounds:.0f} vs {p[n].rounds:.0f}" for n in own_held)
            + ")"
        )
    unknown = [label for label, ps, os, outcome in outcomes if outcome == "not checked"]
    unknown += [f"{n}'s own rounds" for n, c in own.items() if c.outcome == "not checked"]
    if unknown:
        parts.append(f"not checked: {', '.join(unknown)} (a bound, or neither reached)")
    if others:
        parts.append(f"reached by one side only: {', '.join(others)}")
    return ", ".join(parts)


def rounds_verdict(paper: dict[str, Cell], ours: dict[str, Cell], by_value: bool = False) -> str:
    """Order of the rounds to target (not reached = last), the paper's method's own rounds
    (within ``ROUNDS_FACTOR``), its speed-up over each baseline (``by_value``: each swept
    value's over the first) judged on its size (``speedup_outcome``; a bound that cannot
    show agreement is "not checked"), and the cells reached by one side only: none of
    fedsub's reached where the paper's did, or a headline cell (the paper's method; every
    value of a sweep) reached by one side only, is "differs". A cell fedsub did not run
    makes it "not comparable" (or "differs" where the runs present already differ)."""
    return rounds_checks(paper, ours, by_value)[0]


def _side(paper: Rounds, ours: Rounds) -> str:
    if paper.reached:
        if ours.diverged is not None:
            return (
                f"in the paper at {paper.rounds:.0f}, not by fedsub (diverged at {ours.diverged})"
            )
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


def _gap(metric: str, ours: float, paper: float) -> float:
    """The gap in the metric's tolerance units: within when at most 1 (up to rounding)."""
    if absolute_scale(metric):
        return abs(ours - paper) / POINTS
    return relative(ours, paper) / WITHIN


def beyond(gap: float) -> bool:
    """A gap in tolerance units beyond the tolerance (float rounding is not beyond)."""
    return gap > 1 + ROUNDING


def _shown(value: float, digits: int, tolerance: float, past: bool) -> str:
    """``value`` with ``digits`` decimals, more when it would read as ``tolerance`` while
    it is beyond it (never "2.0 points, beyond 2 points")."""
    for d in range(digits, 12):
        text = f"{value:.{d}f}"
        if not past or float(text) != tolerance:
            return text
    return repr(value)


def gap_text(metric: str, ours: float, paper: float) -> str:
    past = beyond(_gap(metric, ours, paper))
    if absolute_scale(metric):
        return f"{_shown(100 * abs(ours - paper), 1, 100 * POINTS, past)} points"
    return f"{_shown(100 * relative(ours, paper), 0, 100 * WITHIN, past)}%"


def tolerance_text(metric: str) -> str:
    return f"{100 * POINTS:g} points" if absolute_scale(metric) else f"{100 * WITHIN:g}%"


def margins(values: dict[str, float], metric: str) -> dict[str, float]:
    """The paper's method's lead over each other algorithm (positive: ahead)."""
    ours = next((n for n in OURS if n in values), None)
    if ours is None:
        return {}
    sign = 1.0 if higher_is_better(metric) else -1.0
    return {n: sign * (values[ours] - v) for n, v in values.items() if n != ours}


def values_checks(
    paper: dict[str, float], ours: dict[str, float | None], metric: str, target: float | None
) -> tuple[str, list[Check]]:
    """``values_verdict`` and its checks, one per claim."""
    known = {n: v for n, v in ours.items() if v is not None and math.isfinite(v)}
    missing = [n for n in paper if n not in known]
    checks = [
        Check("not checked", f"{n}'s {metric}: none here (not run, or not finite)") for n in missing
    ]
    if not known:
        return "not comparable: fedsub has none of these numbers", checks
    reasons: list[str] = []
    reversed_, tied = ranking(paper, known, ("below", "above"))  # none for a single number
    if reversed_:
        reasons.append(_first_of(reversed_))
    checks += [Check("differs", f"order of {metric}: {r}", f"order of {metric}") for r in reversed_]
    if len(known) > 1 and not reversed_:
        checks.append(
            Check("holds", f"order of {metric}: " + ", ".join(known), f"order of {metric}")
        )
    head = f"same ranking up to ties ({tied[0]})" if tied else "same ranking"
    for n in known:
        far = beyond(_gap(metric, known[n], paper[n]))
        x, y = distinct(known[n], paper[n])
        checks.append(
            Check(
                "differs" if far else "holds",
                f"{n}'s {metric} {x} vs the paper's {y} ({gap_text(metric, known[n], paper[n])}, "
                f"{'beyond' if far else 'within'} {tolerance_text(metric)})",
                f"{n}'s {metric}",
            )
        )
    worst = max(known, key=lambda n: _gap(metric, known[n], paper[n]))
    x, y = distinct(known[worst], paper[worst])
    size = f"{worst} {x} vs {y} ({gap_text(metric, known[worst], paper[worst])})"
    if beyond(_gap(metric, known[worst], paper[worst])):
        reasons.append(f"{size}, beyond {tolerance_text(metric)}")
    margin_note = ""
    if absolute_scale(metric):
        margin_checks, margin_note = _margin_checks(paper, known, metric, reasons)
        checks += margin_checks
    if target is not None:
        checks += _target_checks(paper, known, metric, target, reasons)
    absent = f"fedsub has no {', '.join(missing)} {metric} (not run, or not finite)"
    if reasons:
        return "differs: " + "; ".join(reasons) + (
            f"; not comparable: {absent}" if missing else ""
        ), checks
    if missing:
        return f"not comparable: {absent}", checks
    within = f"within {gap_text(metric, known[worst], paper[worst])} ({worst})"
    if len(known) == 1:
        return f"{within}, a single number (nothing ranked)", checks
    return ", ".join(x for x in (head, within, margin_note) if x), checks


def _margin_checks(
    paper: dict[str, float], known: dict[str, float], metric: str, reasons: list[str]
) -> tuple[list[Check], str]:
    """On an absolute scale, the best algorithm's margin over each other one, ours against
    the paper's: one check per margin, the largest miss joins ``reasons``; and the note
    when every margin agrees."""
    theirs, mine = margins(paper, metric), margins(known, metric)
    pairs = [(n, theirs[n], mine[n]) for n in theirs if n in mine]
    off = [(n, t, m) for n, t, m in pairs if beyond(abs(m - t) / POINTS)]
    checks = [
        Check(
            "differs" if (n, t, m) in off else "holds",
            f"margin over {n} {m:+.3f} vs the paper's {t:+.3f}",
            f"margin over {n}",
        )
        for n, t, m in pairs
    ]
    if off:
        n, t, m = max(off, key=lambda x: abs(x[2] - x[1]))
        reasons.append(f"margin over {n} {m:+.3f} vs the paper's {t:+.3f}")
    elif pairs:
        return checks, f"margins within {100 * POINTS:g} points"
    return checks, ""


def _target_checks(
    paper: dict[str, float],
    known: dict[str, float],
    metric: str,
    target: float,
    reasons: list[str],
) -> list[Check]:
    """Each algorithm that reaches the target in the paper reaches it here too; those that
    miss join ``reasons``."""
    reached = [n for n in known if _reaches(paper[n], target, metric)]
    missed = [n for n in reached if not _reaches(known[n], target, metric)]
    if missed:
        reasons.append(
            f"{', '.join(missed)} miss{'es' if len(missed) == 1 else ''} the paper's "
            f"target {metric} {target:g}"
        )
    return [
        Check("differs" if n in missed else "holds", f"{n} reaches the target {metric} {target:g}")
        for n in reached
    ]


def values_verdict(
    paper: dict[str, float],
    ours: dict[str, float | None],
    metric: str = "value",
    target: float | None = None,
) -> str:
    """Ranking, the largest gap (points for AUC / accuracy, relative otherwise), the paper's
    method's margins over the others (AUC / accuracy), and the paper's ``target`` missed by an
    algorithm that reached it in the paper. A number fedsub lacks (not run, or not finite)
    makes it "not comparable", or "differs" where the numbers present already differ."""
    return values_checks(paper, ours, metric, target)[0]


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
    shown = distinct(x, y)
    return text, f"{'holds' if x < y else 'fails'} ({shown[0]} vs {shown[1]})"


def judge(paper: dict[str, Any], table: dict[str, dict], horizon: int) -> tuple[list[ROW], str]:
    """Rows (cell, paper, fedsub) and the verdict for every kind of number the paper gives."""
    rows, verdict, _ = judge_all(paper, table, horizon)
    return rows, verdict


@dataclass
class _Judgement:
    """What ``judge_all`` gathers claim by claim: the report's rows, a verdict per kind of
    claim and the checks."""

    rows: list[ROW] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)


def judge_all(
    paper: dict[str, Any], table: dict[str, dict], horizon: int
) -> tuple[list[ROW], str, list[Check]]:
    """``judge`` with its checks: every claim of the paper, one line each, saying whether it
    holds, differs, or cannot be checked on these runs."""
    judged = _Judgement()
    _judge_rounds(paper, table, horizon, judged)
    _judge_values(paper, table, judged)
    for metric, value in paper.get("lowest", {}).items():
        values = [metric_value(entry, "best", metric) for entry in table.values()]
        lowest = min((v for v in values if v is not None), default=None)
        judged.rows.append((f"lowest {metric} over the runs", number(value), number(lowest)))
        verdict, found = values_checks({"lowest": value}, {"lowest": lowest}, metric, None)
        judged.verdicts.append(verdict)
        judged.checks += found
    shape = paper.get("rounds_shape")
    if shape is not None:
        cells = {n: fedsub_cell(entry, horizon) for n, entry in table.items()}
        judged.rows += [(f"rounds to target at {n}", "", str(c)) for n, c in cells.items()]
        verdict = shape_verdict(shape, cells)
        judged.verdicts.append(verdict)
        judged.checks.append(
            Check(_outcome(verdict), f"shape {shape!r}: {verdict}", f"shape {shape!r}")
        )
    claims = paper.get("claims")
    if claims:
        results = [claim_result(c, table, horizon) for c in claims]
        judged.rows += [(text, "holds", outcome) for text, outcome in results]
        judged.verdicts.append(claims_verdict(results))
        judged.checks += [
            Check(_claim_outcome(outcome), f"{text}: {outcome}", text) for text, outcome in results
        ]
    return judged.rows, combine(judged.verdicts), judged.checks


def _judge_rounds(
    paper: dict[str, Any], table: dict[str, dict], horizon: int, judged: _Judgement
) -> None:
    """The rounds to the target, algorithm by algorithm (or value by value, a sweep's), and
    the speed-ups between them."""
    for kind in ("rounds_to_target", "rounds_by_value"):
        if kind in paper:
            by_value = kind == "rounds_by_value"
            cells = {n: fedsub_cell(table.get(n), horizon) for n in paper[kind]}
            judged.rows += [
                (f"rounds to target: {n}", str(p), str(cells[n])) for n, p in paper[kind].items()
            ]
            judged.rows += [
                (label, p.text() if p else "?", o.text() if o else "?")
                for label, p, o in speedup_rows(paper[kind], cells, by_value)
            ]
            verdict, found = rounds_checks(paper[kind], cells, by_value)
            judged.verdicts.append(verdict)
            judged.checks += found


def _judge_values(paper: dict[str, Any], table: dict[str, dict], judged: _Judgement) -> None:
    """The best and final metrics, algorithm by algorithm, with the margins between them on
    an absolute scale and the target."""
    targets = paper.get("target", {})
    for at in ("best", "final"):
        for metric, by_name in paper.get(at, {}).items():
            ours = {n: metric_value(table.get(n), at, metric) for n in by_name}
            judged.rows += [
                (f"{at} {metric}: {n}", number(p), number(ours[n])) for n, p in by_name.items()
            ]
            if absolute_scale(metric):
                theirs, mine = (
                    margins(by_name, metric),
                    margins({n: v for n, v in ours.items() if v is not None}, metric),
                )
                judged.rows += [
                    (f"{at} {metric}: margin over {n}", f"{t:+.4g}", number(mine.get(n)))
                    for n, t in theirs.items()
                ]
            target = targets.get(metric) if at == "best" else None
            verdict, found = values_checks(by_name, ours, metric, target)
            judged.verdicts.append(verdict)
            judged.checks += [Check(c.outcome, f"{at} {c.text}", f"{at} {c.key}") for c in found]


def _claim_outcome(result: str) -> str:
    if result.startswith("holds"):
        return "holds"
    return "differs" if result.startswith("fails") else "not checked"


def _outcome(verdict: str) -> str:
    if verdict.startswith("same"):
        return "holds"
    return "differs" if verdict.startswith("differs") else "not checked"


# --- several seeds -----------------------------------------------------------------------------


def across_seeds(checks: list[list[Check]]) -> list[Check]:
    """Each claim judged over the runs of several seeds (one list of checks per seed): it
    holds when it holds on every seed, differs when it differs on every seed, and is not
    checked when the seeds disagree (the paper's number inside fedsub's spread) or one could
    not check it; the text is the first seed's, with the count."""
    if len(checks) == 1:
        return checks[0]
    by_seed = [_by_claim(found) for found in checks]
    keys = list(dict.fromkeys(k for found in by_seed for k in found))
    combined = []
    for key in keys:
        seen = [found.get(key) for found in by_seed]
        outcomes = [c.outcome if c else "not checked" for c in seen]
        first = next(c for c in seen if c is not None)
        n = len(outcomes)
        if len(set(outcomes)) == 1:
            combined.append(Check(outcomes[0], f"{first.text} (on all {n} seeds)", key))
            continue
        split = ", ".join(f"{o} on {outcomes.count(o)}" for o in dict.fromkeys(outcomes))
        combined.append(
            Check("not checked", f"{key}: {split} of {n} seeds (seed 1: {first.text})", key)
        )
    return combined


def _by_claim(found: list[Check]) -> dict[str, Check]:
    """A seed's checks by claim: a claim with several lines (an order's reversals) differs
    when one of them does."""
    claims: dict[str, Check] = {}
    for c in found:
        if c.key not in claims or c.outcome == "differs":
            claims[c.key] = c
    return claims


def seeds_verdict(verdicts: list[str]) -> str:
    """A part's verdict over several seeds: the first seed's when every seed's verdict says
    the same (differs, not comparable, not checked, or agrees), else "not comparable" naming
    how the seeds split."""
    if len(verdicts) == 1:
        return verdicts[0]
    words = [_first_word(v) for v in verdicts]
    if len(set(words)) == 1:
        return f"{verdicts[0]} (seed 1's; all {len(verdicts)} seeds: {words[0]})"
    split = ", ".join(f"{w} on {words.count(w)}" for w in dict.fromkeys(words))
    return f"not comparable: the seeds disagree ({split} of {len(verdicts)}); seed 1: {verdicts[0]}"


def _first_word(verdict: str) -> str:
    for word in ("differs", "not comparable", "not checked"):
        if verdict.startswith(word):
            return word
    return "agrees"


def spread(values: list[str]) -> str:
    """fedsub's cell over several seeds: mean ± standard deviation (min-max) of numbers,
    else the seeds' cells."""
    if len(set(values)) == 1:
        return values[0]
    try:
        numbers = [float(v) for v in values]
    except ValueError:
        return values[0] if len(set(values)) == 1 else " / ".join(values)
    mean = sum(numbers) / len(numbers)
    std = math.sqrt(sum((x - mean) ** 2 for x in numbers) / (len(numbers) - 1))
    return f"{mean:.4g} ± {std:.2g} ({min(numbers):.4g}-{max(numbers):.4g})"
