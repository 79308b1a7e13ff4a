"""dp.selection_refresh: fedsub's windowed selection that serves r windows (dp/ftrl.py,
dp/selection.py ``windowed_selections``, dp/settings.py ``selection_count``), checked against
what a run does (the selections recorded from ``selection.select`` and the histograms from
``selection.histogram``) and its accounting against the formula written out here."""

from __future__ import annotations

import math

import dp_accounting
import pytest
import torch
from dp_accounting import rdp

from fedsub.config import Config
from fedsub.dp import selection
from fedsub.errors import ConfigError


@pytest.mark.parametrize(
    ("rounds", "window", "refresh"),
    [(150, 6, 1), (150, 6, 8), (150, 4, 3), (12, 4, 2), (8, 4, 1), (4, 4, 5), (0, 3, 2),
     (13, 4, 2), (150, 40, 1), (150, 6, 24), (150, 6, 25)],
)  # fmt: skip
def test_the_selection_count_is_the_windows_that_start_a_selection(rounds, window, refresh):
    """Round by round: a selection is made at the first round of a window j >= 1 with j - 1
    a multiple of r (windows 1, r + 1, 2r + 1, ...)."""
    made = 0
    for t in range(1, rounds + 1):
        j, first = divmod(t - 1, window)
        if first == 0 and j >= 1 and (j - 1) % refresh == 0:
            made += 1
    assert selection.windowed_selections(rounds, window, refresh) == made


def test_the_selection_count_refuses_a_zero_window_or_refresh() -> None:
    with pytest.raises(ValueError, match="window and refresh must be >= 1"):
        selection.windowed_selections(10, 0, 1)
    with pytest.raises(ValueError, match="window and refresh must be >= 1"):
        selection.windowed_selections(10, 2, 0)


def run_ftrl(overrides: list[str]):
    from fedsub.runs.experiment import compare

    config = Config.from_toml(
        None,
        [
            "train.rounds=13",
            "train.clients_per_round=50",
            "eval.every=13",
            "dp.mechanism='ftrl-tree'",
            "dp.noise_multiplier=1.0",
            "dp.min_separation=4",
            "dp.rows='private'",
            "dp.selection_window=2",
            "dp.selection_threshold=1.0",
            "dp.randomness='seeded'",
            "train.algorithms=['fedsubavg']",
            *overrides,
        ],
    )
    return compare(config, None)


def test_a_refreshed_selection_reads_every_rth_window_and_serves_r_windows(monkeypatch) -> None:
    """13 rounds, w = 2, r = 3: windows 0..6; selections at rounds 3 (window 1, reading
    window 0 = rounds 1-2) and 9 (window 4, reading window 3 = rounds 7-8); rounds 3-8 update
    the first selection's rows, 9-13 the second's; rounds 1-2 none. Each selection's histogram
    is the sum of its window's rounds' histograms (recorded)."""
    from fedsub.dp import ftrl

    made: list[tuple[torch.Tensor, torch.Tensor, selection.Selection]] = []
    select, histogram = selection.select, selection.histogram
    heats: dict[int, torch.Tensor] = {}  # each round's histogram (the rounds that read it)
    touched: list[torch.Tensor] = []
    current = [0]  # the round being combined

    def recorded_select(rows, heat, *args, **kwargs):
        out = select(rows, heat, *args, **kwargs)
        made.append((rows.clone(), heat.clone(), out))
        return out

    def recorded_histogram(inverse, owner, contribution, size):
        out = histogram(inverse, owner, contribution, size)
        heats[current[0]] = out.cpu().to(torch.float64)
        return out

    updated: dict[int, list[int]] = {}
    combine = ftrl.FtrlMechanism.combine

    def recorded(self, update, round_index):
        (distinct,) = [torch.unique(r) for r in update.rows.values()]
        touched.append(distinct.cpu())
        current[0] = round_index
        out = combine(self, update, round_index)
        updated[round_index] = sorted(r for u in out.tables.values() for r in u.rows.tolist())
        return out

    monkeypatch.setattr(selection, "select", recorded_select)
    monkeypatch.setattr(selection, "histogram", recorded_histogram)
    monkeypatch.setattr(ftrl.FtrlMechanism, "combine", recorded)
    run_ftrl(["dp.selection_refresh=3"])
    assert len(made) == 2 == selection.windowed_selections(13, 2, 3)
    for (rows, heat, _), window_rounds in zip(made, [(1, 2), (7, 8)], strict=True):
        expected: dict[int, float] = {}
        for t in window_rounds:
            for row, value in zip(touched[t - 1].tolist(), heats[t].tolist(), strict=True):
                expected[row] = expected.get(row, 0.0) + value
        assert rows.tolist() == sorted(expected)
        assert heat.tolist() == pytest.approx([expected[r] for r in sorted(expected)])
    first, second = (sorted(out.rows.tolist()) for _, _, out in made)
    assert first and second and first != second
    assert [updated[t] for t in (1, 2)] == [[], []]
    assert all(updated[t] == first for t in range(3, 9))
    assert all(updated[t] == second for t in range(9, 14))
    # only the windows a selection reads (0, 3, 6: rounds 1-2, 7-8, 13) compute a histogram
    assert sorted(heats) == [1, 2, 7, 8, 13]


@pytest.mark.parametrize(
    ("mechanism", "refresh"), [("ftrl-tree", 3), ("ftrl-blt", 3), ("ftrl-tree", 1)]
)
def test_skipping_the_histograms_no_selection_reads_changes_no_number(
    mechanism, refresh, monkeypatch
) -> None:
    """``FtrlMechanism.reads_heat``: the rounds of windows whose histogram no selection reads
    skip the contributions and the histogram; every round's update (rows, values) is bit for
    bit the update when every round computes them (``reads_heat`` always true)."""
    from fedsub.dp import ftrl

    if mechanism == "ftrl-blt":
        pytest.importorskip("jax_privacy", reason="ftrl-blt's strategy is jax-privacy's")
    combine, reads, histogram = (
        ftrl.FtrlMechanism.combine,
        ftrl.FtrlMechanism.reads_heat,
        selection.histogram,
    )

    def updates(every_round: bool) -> tuple[list[bytes], int]:
        out: list[bytes] = []
        computed = [0]

        def recorded(self, update, round_index):
            got = combine(self, update, round_index)
            out.extend(
                u.rows.numpy().tobytes() + u.values.numpy().tobytes() for u in got.tables.values()
            )
            out.extend(v.numpy().tobytes() for v in got.dense.values())
            return got

        def counted(*args):
            computed[0] += 1
            return histogram(*args)

        monkeypatch.setattr(ftrl.FtrlMechanism, "combine", recorded)
        monkeypatch.setattr(
            ftrl.FtrlMechanism, "reads_heat", (lambda self, t: True) if every_round else reads
        )
        monkeypatch.setattr(selection, "histogram", counted)
        overrides = [f"dp.mechanism='{mechanism}'", "dp.heat_cap=4"]
        run_ftrl([*overrides, *([f"dp.selection_refresh={refresh}"] if refresh > 1 else [])])
        return out, computed[0]

    (fast, fast_histograms), (slow, slow_histograms) = updates(False), updates(True)
    assert fast == slow
    assert len(set(fast[2:])) > 1  # updates with rows and values
    assert slow_histograms == 13  # one table, 13 rounds
    # the fast path skips: with r = 3 only rounds 1-2, 7-8 and 13 of 13 read the histogram
    assert fast_histograms == (5 if refresh == 3 else 13)


def effective_epsilon(count: int, settings, rounds: int) -> float:
    """The run as one Gaussian: 1 / z_eff^2 = count / z_sel^2 + sens^2 / z_tree^2 (RDP)."""
    sens = settings.accounting.ftrl_sensitivity(rounds)
    inverse = count / settings.selection_multiplier**2 + sens**2 / settings.update_multiplier**2
    event = dp_accounting.GaussianDpEvent(1.0 / math.sqrt(inverse))
    return float(rdp.RdpAccountant().compose(event).get_epsilon(settings.accounting.delta))


@pytest.mark.parametrize("refresh", [1, 2, 3, 6])
def test_the_accounting_charges_the_selections_a_user_can_reach(refresh: int) -> None:
    """z given: the epsilon at every round is the written-out Gaussian's with min(k_max,
    selections made) selection releases (k_max without a refresh), and the selection's noise
    follows the same count (k / z_sel^2 = s / z^2 over the configured rounds)."""
    from fedsub.dp.participation import Pattern
    from fedsub.runs.run_setup import dp_of

    rounds, window, separation = 24, 2, 2
    config = Config.from_toml(
        None,
        [
            f"train.rounds={rounds}",
            "dp.mechanism='ftrl-tree'",
            "dp.noise_multiplier=2.0",
            f"dp.min_separation={separation}",
            "dp.rows='private'",
            f"dp.selection_window={window}",
            *([f"dp.selection_refresh={refresh}"] if refresh > 1 else []),
            "train.algorithms=['fedsubavg']",
        ],
    )
    settings = dp_of(config, 3000)
    assert settings is not None
    k_max = Pattern(separation, 0).most(rounds)  # 12
    total = min(k_max, (rounds // window - 1 + refresh - 1) // refresh) if refresh > 1 else k_max
    assert settings.selection_multiplier**2 == pytest.approx(
        total * settings.noise_multiplier**2 / settings.selection.share
    )
    for t in (1, 3, 5, 11, rounds):
        k = Pattern(separation, 0).most(t)
        made = selection.windowed_selections(t, window, refresh)
        count = min(k, made) if refresh > 1 else k
        assert settings.epsilon(t) == pytest.approx(effective_epsilon(count, settings, t), 1e-9)
    # a refresh spends less on the selection, and calibration still meets the target
    assert refresh == 1 or total < k_max


def test_a_calibrated_refresh_run_spends_the_target() -> None:
    from fedsub.runs.run_setup import dp_of

    config = Config.from_toml(
        None,
        [
            "train.rounds=24",
            "dp.mechanism='ftrl-tree'",
            "dp.target_epsilon=2.0",
            "dp.min_separation=2",
            "dp.rows='private'",
            "dp.selection_window=2",
            "dp.selection_refresh=4",
            "train.algorithms=['fedsubavg']",
        ],
    )
    settings = dp_of(config, 3000)
    assert settings is not None
    assert settings.selection_count(24) == 3  # windows 1, 5, 9 of 0..11
    assert settings.epsilon(24) == pytest.approx(2.0, rel=1e-3)
    assert effective_epsilon(3, settings, 24) == pytest.approx(2.0, rel=1e-3)


def test_a_refresh_is_refused_where_it_would_be_ignored() -> None:
    ftrl = ["dp.mechanism='ftrl-tree'", "dp.noise_multiplier=1.0", "dp.min_separation=4"]
    private = [*ftrl, "dp.rows='private'", "train.algorithms=['fedsubavg']"]
    with pytest.raises(ConfigError, match="selection_refresh applies to mechanism = 'ftrl-tree'"):
        Config.from_toml(
            None, ["dp.mechanism='gaussian'", "dp.noise_multiplier=1.0", "dp.selection_refresh=2"]
        )
    with pytest.raises(ConfigError, match=r"selection_refresh = 2 .* dp\.selection_window = 1"):
        Config.from_toml(None, [*private, "dp.selection_refresh=2"])
    with pytest.raises(ConfigError, match=r"selection_refresh = 2 .* dp\.rows = 'all'"):
        Config.from_toml(
            None,
            [*ftrl, "dp.rows='all'", "dp.selection_window=2", "dp.selection_refresh=2",
             "train.algorithms=['fedavg']"],
        )  # fmt: skip
    with pytest.raises(ConfigError, match="selection_refresh"):
        Config.from_toml(None, ["dp.selection_refresh=0"])
