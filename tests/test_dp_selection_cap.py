"""dp.selection_max_rows: fedsub's cap on the rows of a DP-FTRL selection (dp/selection.py
``largest``, dp/ftrl.py), checked against its rule written out here: of the rows the noisy
histogram selected, the M of the largest noisy values (ties: the lower row)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsub.config import Config
from fedsub.dp import selection
from fedsub.errors import ConfigError


def random_selection(size: int, seed: int) -> selection.Selection:
    generator = np.random.default_rng(seed)
    rows = np.sort(generator.choice(10_000, size=size, replace=False))
    position = np.where(generator.random(size) < 0.3, -1, np.arange(size))
    heat = np.round(generator.normal(5.0, 2.0, size), 1)  # rounded: ties happen
    return selection.Selection(
        torch.from_numpy(rows), torch.from_numpy(position), torch.from_numpy(heat)
    )


@pytest.mark.parametrize("limit", [1, 7, 40, 99])
def test_largest_keeps_the_rows_of_the_largest_noisy_values(limit: int) -> None:
    chosen = random_selection(100, limit)
    triples = list(
        zip(
            chosen.rows.tolist(),
            chosen.touched_position.tolist(),
            chosen.noisy_heat.tolist(),
            strict=True,
        )
    )
    ranked = sorted(triples, key=lambda t: (-t[2], t[0]))  # heat descending, then the row
    expected = sorted(ranked[:limit])  # by row
    got = selection.largest(chosen, limit)
    assert (
        list(
            zip(
                got.rows.tolist(),
                got.touched_position.tolist(),
                got.noisy_heat.tolist(),
                strict=True,
            )
        )
        == expected
    )
    assert len(got.rows) == limit
    # every dropped row's value is at most every kept row's
    dropped = [t[2] for t in triples if t not in expected]
    assert max(dropped) <= min(got.noisy_heat.tolist())


def test_largest_leaves_a_small_selection_or_no_cap_alone() -> None:
    chosen = random_selection(30, 0)
    assert selection.largest(chosen, 30) is chosen
    assert selection.largest(chosen, 31) is chosen
    assert selection.largest(chosen, 0) is chosen


def run_ftrl(overrides: list[str]):
    from fedsub.runs.experiment import compare

    config = Config.from_toml(
        None,
        [
            "train.rounds=8",
            "train.clients_per_round=50",
            "eval.every=8",
            "dp.mechanism='ftrl-tree'",
            "dp.noise_multiplier=1.0",
            "dp.min_separation=4",
            "dp.selection_threshold=1.0",
            "dp.randomness='seeded'",
            "train.algorithms=['fedsubavg']",
            *overrides,
        ],
    )
    return compare(config, None)


@pytest.mark.parametrize("window", [1, 4])
def test_a_capped_run_updates_the_top_rows_of_each_selection(monkeypatch, window: int) -> None:
    """In a run, each round's updated rows are the M largest of the selection the noisy
    histogram made (recorded from ``selection.select``), per round or per window."""
    from fedsub.dp import ftrl

    limit = 5
    selections: list[selection.Selection] = []
    select = selection.select

    def recorded_select(*args, **kwargs):
        out = select(*args, **kwargs)
        selections.append(out)
        return out

    updated: dict[int, list[int]] = {}
    combine = ftrl.FtrlMechanism.combine

    def recorded(self, update, round_index):
        out = combine(self, update, round_index)
        updated[round_index] = sorted(r for u in out.tables.values() for r in u.rows.tolist())
        return out

    monkeypatch.setattr(selection, "select", recorded_select)
    monkeypatch.setattr(ftrl.FtrlMechanism, "combine", recorded)
    run_ftrl([f"dp.selection_window={window}", f"dp.selection_max_rows={limit}"])
    assert selections and max(len(s.rows) for s in selections) > limit  # the cap bites
    expected = []
    for s in selections:
        triples = zip(s.rows.tolist(), s.noisy_heat.tolist(), strict=True)
        ranked = sorted(triples, key=lambda t: (-t[1], t[0]))
        expected.append(sorted(row for row, _ in ranked[:limit]))
    if window == 1:
        assert [updated[r] for r in sorted(updated)] == expected
    else:  # the first window updates nothing; each later one its selection, every round
        assert [updated[r] for r in (1, 2, 3, 4)] == [[]] * 4
        assert [updated[r] for r in (5, 6, 7, 8)] == [expected[0]] * 4


def test_the_cap_spends_no_privacy() -> None:
    """Post-processing: the epsilon reported with the cap is the one without it."""
    plain = run_ftrl(["dp.selection_window=4"]).summary["algorithms"]["fedsubavg"]["dp"]
    capped = run_ftrl(["dp.selection_window=4", "dp.selection_max_rows=3"])
    assert capped.summary["algorithms"]["fedsubavg"]["dp"]["epsilon"] == plain["epsilon"]


def test_the_cap_is_refused_where_it_would_be_ignored() -> None:
    with pytest.raises(ConfigError, match="selection_max_rows applies to mechanism = 'ftrl-tree'"):
        Config.from_toml(
            None, ["dp.mechanism='gaussian'", "dp.noise_multiplier=1.0", "dp.selection_max_rows=9"]
        )
    with pytest.raises(ConfigError, match=r"selection_max_rows = 9 caps .* dp\.rows = 'all'"):
        Config.from_toml(
            None,
            [
                "dp.mechanism='ftrl-tree'",
                "dp.noise_multiplier=1.0",
                "dp.min_separation=4",
                "dp.rows='all'",
                "dp.selection_max_rows=9",
                "train.algorithms=['fedavg']",
            ],
        )
    with pytest.raises(ConfigError, match="selection_max_rows"):
        Config.from_toml(None, ["dp.selection_max_rows=-1"])


@pytest.mark.parametrize(
    ("epsilon", "k", "rounds", "separation", "num_rows"),
    [(1.0, 50, 150, 50, 20_009), (2.0, 50, 150, 50, 20_009), (0.5, 1000, 150, 30, 20_009),
     (3.0, 10, 30, 2, 99), (8.0, 50, 600, 50, 1_000_000), (4.0, 5, 3, 1, 50),
     (2.0, 50, 60, 50, 20_009), (1.0, 50, 2, 5, 20_009), (1.5, 7, 900, 400, 20_009),
     (1.0, 500, 150, 6, 20_009), (2.0, 500, 150, 6, 20_009), (1.0, 100, 150, 50, 20_009),
     (1.0, 3000, 150, 1, 20_009), (1.0, 3000, 150, 20, 20_009), (2.0, 500, 20, 6, 20_009),
     (1.0, 50, 100, 50, 20_009), (1.0, 1000, 100, 50, 20_009)],
)  # fmt: skip
def test_the_capped_rule_is_the_written_out_rule(epsilon, k, rounds, separation, num_rows) -> None:
    """capped_rule against its rule written out: BLT, w = min(b, ceil(2000 / K), T // 3) (at
    least 1) unless that covers more than 3 windows after the first (counted round by round
    here), then w = min(b, T // 3) (at least 1); one selection, the refresh r the windows
    after the first (r = 1 when w = 1); M = 1% of V (at least 1), heat cap min(4, max(1,
    epsilon sqrt(K / 50))), threshold 2, B = 6, share 0.3 (0.5 when w = 1)."""

    def made(window: int) -> int:  # selections at the first round of windows 1, 2, ...
        return sum(1 for t in range(2, rounds + 1) if (t - 1) % window == 0)

    rule = selection.capped_rule(epsilon, k, rounds, separation, num_rows)
    window = min(separation, -(-2000 // k), rounds // 3)  # -(-a // b): a / b rounded up
    window = window if window >= 1 else 1
    if made(window) > 3:
        window = min(separation, rounds // 3)
        window = window if window >= 1 else 1
    refresh = made(window) if window > 1 and made(window) > 0 else 1
    scaled = epsilon * (k / 50) ** 0.5
    cap = 1.0 if scaled < 1 else (4.0 if scaled > 4 else scaled)
    assert rule == selection.CappedRule(
        mechanism="ftrl-blt",
        window=window,
        share=0.3 if window > 1 else 0.5,
        threshold=2.0,
        heat_cap=cap,
        bound=6.0,
        max_rows=num_rows // 100 if num_rows >= 100 else 1,
        refresh=refresh,
    )
    assert type(rule.window) is int and type(rule.refresh) is int  # counts of rounds, windows
    assert rule.window <= separation  # the windowed selection's accounting needs w <= b
    assert rule.max_rows <= max(1, num_rows / 100)
    if rule.window > 1:  # a run makes one selection
        assert selection.windowed_selections(rounds, rule.window, rule.refresh) == 1


@pytest.mark.parametrize(
    ("k", "separation", "window", "refresh"), [(50, 50, 40, 3), (500, 6, 6, 24), (1000, 30, 30, 4)]
)
def test_the_capped_rule_at_its_measured_settings(k, separation, window, refresh) -> None:
    """The rule's settings at the points benchmarks/README.md measured, 150 rounds: K = 50, b
    = 50, K = 500, b = 6 and 30,000 users' K = 1,000, b = 30, each one selection at share
    0.3 (stop 60; before it three and two selections at 0.5 at the last two)."""
    for epsilon in (1.0, 2.0, 4.0, 8.0):
        rule = selection.capped_rule(epsilon, k, 150, separation, 20_009)
        cap = min(4.0, max(1.0, epsilon * (k / 50) ** 0.5))
        assert rule == selection.CappedRule("ftrl-blt", window, 0.3, 2.0, cap, 6.0, 200, refresh)
        assert selection.windowed_selections(150, rule.window, rule.refresh) == 1
    assert selection.capped_rule(1.0, 500, 150, 6, 20_009).heat_cap == pytest.approx(10**0.5)


def test_the_capped_rule_refuses_what_it_cannot_use() -> None:
    smallest = selection.capped_rule(1e-9, 1, 1, 1, 1)  # every count at its least, accepted
    assert (smallest.window, smallest.refresh, smallest.max_rows) == (1, 1, 1)
    with pytest.raises(ValueError, match="capped_rule needs epsilon > 0"):
        selection.capped_rule(0.0, 50, 150, 50, 20_009)
    with pytest.raises(ValueError, match="min_separation, num_rows >= 1"):
        selection.capped_rule(1.0, 50, 150, 0, 20_009)


@pytest.mark.parametrize(("epsilon", "k", "rounds", "separation"), [(1.0, 50, 12, 3),
                         (2.0, 50, 12, 3), (1.0, 500, 24, 2), (1.0, 1000, 12, 3)])  # fmt: skip
def test_the_capped_rules_run_spends_the_target_epsilon(epsilon, k, rounds, separation) -> None:
    """The rule picks only public settings: the epsilon a run with them is calibrated to and
    accounts is the target, and the budget is split as DP-FTRL's accounting writes it
    (k / z_sel^2 + sens^2 / z_blt^2 = 1 / z^2, sens the BLT strategy's, k = k_max or, with
    the rule's refresh, the selections made)."""
    pytest.importorskip("jax_privacy", reason="the rule's noise is ftrl-blt (fedsub[blt])")
    from fedsub.dp import blt_noise
    from fedsub.dp.participation import Pattern
    from fedsub.runs.run_setup import dp_of

    rule = selection.capped_rule(epsilon, k, rounds, separation, 20_009)
    # one selection: K = 50: w 3, r 3; K = 500: w 2, r 11; K = 1,000: w 3, r 3
    assert rule.refresh == {50: 3, 500: 11, 1000: 3}[k]
    config = Config.from_toml(
        None,
        [
            f"train.rounds={rounds}",
            f"dp.mechanism='{rule.mechanism}'",
            f"dp.target_epsilon={epsilon}",
            f"dp.min_separation={separation}",
            "dp.blt_buffers=2",
            "dp.rows='private'",
            f"dp.selection_window={rule.window}",
            f"dp.selection_share={rule.share}",
            f"dp.selection_threshold={rule.threshold}",
            f"dp.heat_cap={rule.heat_cap}",
            f"dp.selection_bound={rule.bound}",
            f"dp.selection_max_rows={rule.max_rows}",
            *([f"dp.selection_refresh={rule.refresh}"] if rule.refresh > 1 else []),
            "train.algorithms=['fedsubavg']",
        ],
    )
    settings = dp_of(config, 3000)
    assert settings is not None and settings.mechanism == "ftrl-blt"
    pattern = Pattern(separation, 0)
    sens = blt_noise.sensitivity(blt_noise.optimized(rounds, pattern, 2), rounds, pattern)
    k = pattern.most(rounds)  # the selections a user adds to: k_max, or those made (refresh)
    w, r = rule.window, rule.refresh
    made = sum(
        1 for t in range(w + 1, rounds + 1) if (t - 1) % w == 0 and ((t - 1) // w - 1) % r == 0
    )
    k = min(k, made) if r > 1 else k
    inverse = k / settings.selection_multiplier**2 + sens**2 / settings.update_multiplier**2
    assert inverse == pytest.approx(1 / settings.noise_multiplier**2, rel=1e-9)
    assert settings.selection_multiplier**2 == pytest.approx(
        k * settings.noise_multiplier**2 / rule.share
    )
    assert settings.epsilon(rounds) == pytest.approx(epsilon, rel=1e-3)


@pytest.mark.parametrize(
    "epsilon, k, rounds, separation, refresh",
    [(1.0, 50, 150, 50, 3), (4.0, 500, 150, 6, 24), (2.0, 1000, 150, 30, 4), (2.0, 50, 120, 50, 2)],
)
def test_the_capped_rules_overrides_configure_its_settings(
    epsilon, k, rounds, separation, refresh
) -> None:
    """``CappedRule.overrides`` read back through the config: every setting of the rule lands
    on its own [dp] key (a swapped or missing key fails here), the refreshes 3, 24, 4 and 2
    among them (2 the smallest written: 1 is the default)."""
    rule = selection.capped_rule(epsilon, k, rounds, separation, 20_009)
    assert rule.refresh == refresh
    dp = Config.from_toml(None, [*rule.overrides(separation), f"dp.target_epsilon={epsilon}"]).dp
    chosen = dp.row_selection
    read = (
        dp.mechanism,
        dp.participation.min_separation,
        chosen.rows,
        chosen.selection_window,
        chosen.selection_share,
        chosen.heat_cap,
        chosen.selection_threshold,
        chosen.selection_bound,
        chosen.selection_max_rows,
        chosen.selection_refresh,
    )
    expected = (
        rule.mechanism,
        separation,
        "private",
        rule.window,
        rule.share,
        rule.heat_cap,
        rule.threshold,
        rule.bound,
        rule.max_rows,
        rule.refresh,
    )
    assert read == expected
    assert rule.refresh > 1  # both cases set the refresh key (K = 50: 3, K = 500: 8)
