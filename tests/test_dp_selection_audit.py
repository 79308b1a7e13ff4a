"""Canary audits of what tests/test_dp_ftrl_audit.py leaves out of DP-FTRL (issue 50): the
windowed private selection (``dp.selection_window``), FedSubAvg's noisy-heat divisor, the
``dp.max_participations`` pattern, and the selection's noise redrawn from train.seed. Each
drives fedsub's own code (the mechanism built by ``MECHANISMS``, its ``combine``, the cohorts
under the enforced ``ParticipationBound``, ``selection.select`` for the attacker's replay) on
test_dp_ftrl_audit's vectorised trials (T canary rows, T rows without), with its attacks
(``likelihood``, ``redrawn``) and eps_lb (test_dp_audit's ``epsilon_lower_bound``).

- **Windowed selection** (w = 2 <= b = 2; ftrl-tree and ftrl-blt): a window's rows are
  chosen at its first round from the previous window's histogram and then released every
  round of the window. The likelihood attack counts the selections that read a window the
  canary took part in; the distance check splits the attack's distance between the worlds
  into the prefix sums' (Delta_G, from the measured noise covariance) and the selection's,
  measured from the trials: probit(p_out) - probit(p_in) per selection, the canary's heat 1
  over the selection noise's std, z_sel B as the accounting charges (a histogram counting
  the canary twice, or a smaller noise, moves it).
- **The refreshed selection** (``dp.selection_refresh`` = R = 2, w = 2): one selection serves
  R windows and reads only windows 0, R, ...; the canary takes part in every window, read or
  not. The selection's distance per selection (and its noisy heat's std) is the one the
  accounting charges for min(k_max, S) = 2 selections, written out here; the attacks stay
  below the reported epsilon (the redrawn one passes it in seeded mode); a canary only in the
  unread windows leaves the released rows and noisy heat the same bit for bit.
- **Noisy heat** (FedSubAvg): a run with the rule's heat and one without, on one secret,
  give each released row's divisor D v_plain / v_heat: in seeded mode it is checked against
  the selection replayed from train.seed (the divisor is the selection's own noisy value
  over w, raised to D / heat_cap: dp/ftrl.py), in secret mode its distribution against the
  truncated Gaussian of std z_sel B above the threshold (the count's noise has the scale the
  accounting charges), and the replay from the seed does not find it; the same for the
  Gaussian mechanism's round with private rows (dp/mechanism.py step 5).
- **max_participations** (k = 2, b = 1): every canary asks for every round; the bound lets
  it into rounds 1 and 2 only (the tree's worst case for k = 2), the attacks stay below the
  reported epsilon and the distance is the one the accounting charges for the pattern.
- **The selection redrawn from train.seed**: the attacker replays the selection of the world
  with the canaries (``selection.select`` on the round's stream keyed by train.seed) and
  counts the released selections that agree with it; a canary's row always agrees in seeded
  mode, a row without one half the time a selection, so eps_lb passes the reported epsilon by
  far; in secret mode the replay is independent of the run and eps_lb stays below (DP-FTRL
  per round and windowed, and the Gaussian mechanism's private rows over 8 rounds).

Mutations each audit was checked to catch (applied by hand, then reverted) are listed in
docs/tutorials/differential-privacy.md.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from scipy import stats

from fedsub.dp import selection
from fedsub.dp.ftrl import FtrlMechanism
from fedsub.dp.mechanism import round_generator
from fedsub.dp.mechanisms import MECHANISMS, MechanismInputs
from fedsub.dp.participation import Pattern
from fedsub.dp.randomness import DpStreams
from fedsub.dp.settings import DpSettings, Randomness, Rows
from fedsub.submodel.transfer import CohortUpdate
from tests.test_dp_audit import PUBLIC_SEED, canary_update
from tests.test_dp_audit import settings_of as gaussian_settings
from tests.test_dp_ftrl import drawn_cohorts
from tests.test_dp_ftrl_audit import (
    BLT,
    CANARIES,
    CLIP,
    SELECTION,
    Release,
    Z,
    audited,
    bounds_of,
    built,
    canary_distance,
    ftrl_settings,
    noise_covariance,
    run,
    shadow_covariance,
)

WINDOWED = dataclasses.replace(SELECTION, window=2)
# name: (rounds, pattern, selection, rows)
SETUPS = {
    "window": (8, Pattern(2, 0), WINDOWED, "private"),
    "window-long": (16, Pattern(2, 0), WINDOWED, "private"),  # 7 selections of a canary
    # dp.selection_refresh = 2: selections at rounds 3 and 7 (reading windows 0 and 2)
    "refresh": (8, Pattern(2, 0), dataclasses.replace(WINDOWED, refresh=2), "private"),
    "per-round": (8, Pattern(1, 0), SELECTION, "private"),  # 8 selections of a canary
    "k2-all": (8, Pattern(1, 2), SELECTION, "all"),
    "k2-private": (8, Pattern(1, 2), SELECTION, "private"),
}
# the Gaussian mechanism's (z, rounds): one round for the heat, 8 rounds (epsilon 2.11) for the
# selection's replay
GAUSSIAN = {"gaussian": (Z, 1), "gaussian-8": (6.0, 8)}
REPORTED = 2.25  # every DP-FTRL setup: one Gaussian of z = 2 over the whole run (PLD, delta 1e-6)
KS_ALPHA = 1e-4  # the distribution checks' false alarm


def settings_of(
    setup: str, randomness: Randomness, heat_cap: float = 0.0, mechanism: str = "ftrl-tree"
) -> DpSettings:
    if setup in GAUSSIAN:  # dp/mechanism.py's rounds: every client (q = 1), private rows
        z, rounds = GAUSSIAN[setup]
        base = gaussian_settings(z, 2 * CANARIES, 2 * CANARIES, randomness)
        accounting = dataclasses.replace(base.accounting, rounds=rounds)
        return dataclasses.replace(
            base, clip=CLIP, rows="private", selection=SELECTION, accounting=accounting
        )
    rounds, pattern, chosen, rows = SETUPS[setup]
    chosen = dataclasses.replace(chosen, heat_cap=heat_cap)
    return ftrl_settings(
        mechanism, rows, randomness, rounds=rounds, pattern=pattern, selection=chosen
    )


def released(
    settings: DpSettings,
    heat: bool = False,
    streams: DpStreams | None = None,
    absent: frozenset[int] = frozenset(),
):
    """A run of ``settings`` on the T canaries (``streams``: default a fresh key; DP-FTRL's
    canaries stay out of the rounds ``absent``); the Gaussian mechanism's: every round all
    the canaries (the other rows' clients absent)."""
    streams = streams or DpStreams(settings.randomness, PUBLIC_SEED)
    n, rounds = 2 * CANARIES, settings.accounting.rounds
    if settings.accounting.ftrl is not None:
        return run(built(settings, n, streams, heat), CANARIES, absent)
    inputs = MechanismInputs(settings, {"t": n}, np.ones(n), heat, 1.0, streams)
    mechanism = MECHANISMS["gaussian"].build(inputs)
    values, shown = np.zeros((n, rounds)), np.zeros((n, rounds), dtype=bool)
    for r in range(1, rounds + 1):
        update = mechanism.combine(canary_update(np.arange(CANARIES), CANARIES), r).tables["t"]
        rows = update.rows.numpy()
        values[rows, r - 1] = update.values[:, 0].numpy() * settings.accounting.clients_per_round
        shown[rows, r - 1] = True
    return Release(values, shown, np.ones(rounds, dtype=bool))


@functools.cache
def covariance_of(setup: str, mechanism: str = "ftrl-tree") -> np.ndarray:
    return shadow_covariance(settings_of(setup, "secret", mechanism=mechanism))


def selection_rounds(settings: DpSettings, part: np.ndarray) -> dict[int, bool]:
    """Each round that draws a selection, and whether its histogram counted the canaries:
    every round (counted when they take part), or each window's first round after the first
    window (counted when they took part in the previous window); with dp.selection_refresh
    = R only windows 1, 1 + R, 1 + 2R, ... draw one (reading windows 0, R, 2R, ...)."""
    w, rounds = settings.selection.window, len(part)
    if w == 1:
        return {r: bool(part[r - 1]) for r in range(1, rounds + 1)}
    step = w * settings.selection.refresh
    return {r: bool(part[r - 1 - w : r - 1].any()) for r in range(w + 1, rounds + 1, step)}


def decided(settings: DpSettings, release: Release) -> np.ndarray:
    """The rounds whose selection counted the canaries (``likelihood``'s ``decided``)."""
    counted = selection_rounds(settings, release.part)
    return np.array([counted.get(r, False) for r in range(1, len(release.part) + 1)])


def replayed(settings: DpSettings, part: np.ndarray) -> dict[int, selection.Selection]:
    """The attacker's replay of each selection of the world with the canaries (each counted
    once, heat 1, when the selection counted them) by fedsub's ``selection.select`` on the
    round's stream keyed by the published train.seed."""
    out = {}
    for r, counted in selection_rounds(settings, part).items():
        touched = torch.arange(CANARIES if counted else 0)
        out[r] = selection.select(
            touched,
            torch.ones(len(touched), dtype=torch.float64),
            2 * CANARIES,
            settings.selection_std,
            settings.histogram_threshold,
            round_generator(PUBLIC_SEED, r),
        )
    return out


def selection_agreement(settings: DpSettings, release: Release) -> np.ndarray:
    """Per row, the selections that counted the canaries where the row's release agrees with
    the replay's choice of the canary row it is paired with (row i with canary i mod T)."""
    agree = np.zeros(2 * CANARIES)
    for r, chosen in replayed(settings, release.part).items():
        if not decided(settings, release)[r - 1]:
            continue
        predicted = np.zeros(CANARIES, dtype=bool)
        rows = chosen.rows.numpy()
        predicted[rows[rows < CANARIES]] = True
        agree += release.released[:, r - 1] == np.tile(predicted, 2)
    return agree


def selection_bound(settings: DpSettings, release: Release) -> float:
    """eps_lb of the replay attack: "in" when all (or all but one) selections agree."""
    k = int(decided(settings, release).sum())
    agreement = selection_agreement(settings, release)
    return bounds_of({"selection": (agreement, (k - 1.5, k - 0.5))})["selection"]


def selection_distance(settings: DpSettings, release: Release) -> float:
    """probit(p_out) - probit(p_in) of the selections that counted the canaries: the
    canary's heat over the selection noise's std."""
    chosen = release.released[:, decided(settings, release)]
    p_in, p_out = chosen[:CANARIES].mean(), chosen[CANARIES:].mean()
    return float(stats.norm.isf(p_out) - stats.norm.isf(p_in))


# -- the windowed selection -------------------------------------------------------------------


WINDOWED_MECHANISMS = pytest.mark.parametrize(
    "mechanism", ["ftrl-tree", pytest.param("ftrl-blt", marks=BLT)]
)


@WINDOWED_MECHANISMS
def test_the_windowed_selection_audit_stays_below_the_reported_epsilon(mechanism) -> None:
    settings = settings_of("window", "secret", mechanism=mechanism)
    release = released(settings)
    assert release.part.tolist() == [True, False] * 4  # rounds 1, 3, 5, 7 (b = 2)
    assert not release.released[:, :2].any()  # the first window updates no row
    covariance = covariance_of("window", mechanism)
    outcome = audited(release, settings, covariance, decided(settings, release))
    bounds = {**outcome.bounds, "selection": selection_bound(settings, release)}
    assert outcome.reported == pytest.approx(REPORTED, abs=0.01)
    assert max(bounds.values()) <= outcome.reported, bounds
    assert bounds["likelihood"] > 0.2, bounds  # the attack has power (measured 0.37-0.51)
    assert outcome.contribution == pytest.approx(1.0, abs=0.3)  # each release adds C


@WINDOWED_MECHANISMS
def test_the_windowed_selection_is_seen_at_the_distance_the_accounting_charges(mechanism) -> None:
    """The prefix sums' distance is the per-round selection's tree noise's (the same pattern
    and noise: test_dp_ftrl_audit's covariance) at the rounds the windows release, 3 to 8
    (the first window's participation is never released: measured 0.268 of the tree's share
    0.354 of 1 / z), the selection's is the canary's heat 1 over z_sel B (a window's
    histogram counts a user once), and together they are at most 1 / z."""
    settings = settings_of("window", "secret", mechanism=mechanism)
    release = released(settings)
    gaussian = canary_distance(settings, covariance_of("window", mechanism))
    mean = settings.clip * np.cumsum(release.part[2:])  # the canary at rounds 3, 5, 7
    reference = noise_covariance(mechanism, "private")[2:, 2:]
    assert gaussian == pytest.approx(np.sqrt(mean @ np.linalg.solve(reference, mean)), rel=0.1)
    assert gaussian <= np.sqrt(1 - settings.selection.share) / Z
    per_selection = selection_distance(settings, release)
    # its std from 60,000 trials of each world: about 0.007
    assert per_selection == pytest.approx(1 / settings.selection_std, abs=0.035)
    selections = int(decided(settings, release).sum())
    assert selections == 3  # windows 0, 1, 2 are read by the selections of rounds 3, 5, 7
    total = np.sqrt(gaussian**2 + selections * (1 / settings.selection_std) ** 2)
    assert total <= 1.05 / Z


@WINDOWED_MECHANISMS
def test_the_windowed_audit_catches_noise_drawn_from_the_published_seed(mechanism) -> None:
    settings = settings_of("window", "seeded", mechanism=mechanism)
    release = released(settings)
    covariance = covariance_of("window", mechanism)
    outcome = audited(release, settings, covariance, decided(settings, release))
    assert outcome.bounds["redrawn"] > outcome.reported + 3, outcome.bounds
    assert outcome.bounds["likelihood"] <= outcome.reported, outcome.bounds


# -- the selection's noise redrawn from train.seed ---------------------------------------------


@pytest.mark.parametrize("setup", ["per-round", "window-long", "gaussian-8"])
def test_the_selection_replayed_from_the_seed_tells_only_seeded_runs_apart(setup) -> None:
    secret, seeded = settings_of(setup, "secret"), settings_of(setup, "seeded")
    secret_release, seeded_release = released(secret), released(seeded)
    reported = secret.epsilon(secret.accounting.rounds)
    assert reported == pytest.approx(2.11 if setup in GAUSSIAN else REPORTED, abs=0.01)
    assert selection_bound(secret, secret_release) <= reported
    # every canary row agrees with the replay; a row without one at 0.506^7 (window-long)
    assert selection_bound(seeded, seeded_release) > reported + 2


# -- FedSubAvg's noisy heat ---------------------------------------------------------------------


def divisors(settings: DpSettings) -> tuple[Release, np.ndarray]:
    """One run without the heat and one with it, on one key: each released row's divisor
    D v_plain / v_heat (0 where not released)."""
    streams = DpStreams(settings.randomness, PUBLIC_SEED)
    plain = released(settings, False, streams)
    heated = released(settings, True, streams)
    assert np.array_equal(plain.released, heated.released)
    denominator = settings.accounting.clients_per_round
    ratio = np.divide(
        plain.values, heated.values, out=np.zeros_like(plain.values), where=plain.released
    )
    return plain, denominator * ratio


@pytest.mark.parametrize(
    ("setup", "heat_cap"),
    [
        ("per-round", 0.0),
        ("per-round", 4000.0),
        ("window", 0.0),
        ("window", 4000.0),
        ("refresh", 0.0),
        ("gaussian", 0.0),
    ],
)
def test_the_heat_divides_by_the_selections_noisy_value(setup, heat_cap) -> None:
    """Seeded: the divisor of every released row is the replayed selection's noisy value of
    the row over w, raised to D / heat_cap (dp/ftrl.py; the Gaussian mechanism's, dp/
    mechanism.py step 5: the noisy value), for the w R rounds it releases (R: dp.
    selection_refresh)."""
    settings = settings_of(setup, "seeded", heat_cap)
    release, divisor = divisors(settings)
    floor = settings.accounting.clients_per_round / heat_cap if heat_cap else 0.0
    w, served = settings.selection.window, settings.selection.window * settings.selection.refresh
    for r, chosen in replayed(settings, release.part).items():
        rows = chosen.rows.numpy()
        expected = np.maximum(chosen.noisy_heat.numpy() / w, floor)
        for t in range(r, min(r + served, len(release.part) + 1)):
            assert np.array_equal(np.flatnonzero(release.released[:, t - 1]), rows)
            np.testing.assert_allclose(divisor[rows, t - 1], expected, rtol=1e-9)
    if heat_cap:
        assert np.isclose(divisor[release.released], floor).mean() > 0.2  # it binds


@pytest.mark.parametrize("setup", ["per-round", "window", "gaussian"])
def test_the_heats_noise_is_secret_and_of_the_scale_charged(setup) -> None:
    """Secret: each selection's divisors times w, of the canary rows and of the others, are
    the heat (1, 0) plus Gaussian noise of std z_sel B given that it reached the threshold;
    the replay from train.seed finds neither the rows nor the values."""
    settings = settings_of(setup, "secret")
    release, divisor = divisors(settings)
    for r, chosen in replayed(settings, release.part).items():
        shown = release.released[:, r - 1]
        assert not np.array_equal(np.flatnonzero(shown), chosen.rows.numpy())
    check_heat_noise(settings, release, divisor, settings.selection_std)


def check_heat_noise(
    settings: DpSettings, release: Release, divisor: np.ndarray, std: float
) -> None:
    """The divisors times w at the selections that counted the canaries, of the canary rows
    and of the others: the heat (1, 0) plus Gaussian noise of std ``std`` (z_sel B) given
    that it reached the threshold tau ``std`` (KS tests)."""
    threshold, w = settings.selection.threshold * std, settings.selection.window
    counted = decided(settings, release)
    for heat, rows in ((1.0, slice(0, CANARIES)), (0.0, slice(CANARIES, None))):
        values = w * divisor[rows][:, counted][release.released[rows][:, counted]]
        tail = stats.truncnorm((threshold - heat) / std, np.inf, loc=heat, scale=std)
        assert stats.kstest(values, tail.cdf).pvalue > KS_ALPHA, (heat, len(values))


# -- the refreshed selection (dp.selection_refresh) ---------------------------------------------

# the refresh setup's selections: windows 1 and 3 (rounds 3 and 7), of 4 windows a canary is in
REFRESH_SELECTIONS = 2


@WINDOWED_MECHANISMS
def test_the_refreshed_selection_is_seen_at_the_distance_the_accounting_charges(mechanism) -> None:
    """w = 2, R = 2 over 8 rounds: the canary takes part in every window (rounds 1, 3, 5, 7);
    the selections of rounds 3 and 7 read windows 0 and 2 only and serve rounds 3-6 and 7-8.
    The accounting charges min(k_max = 4, S = 2) selections, z_sel = z sqrt(2 / s) (4, not
    k_max's 5.66): per selection the worlds are 1 / z_sel apart, in the released rows and in
    the noisy heat (the divisor times w: that std around the heat 1), 2 of them s / z^2 in
    all; with the prefix sums' at most 1 / z, and the attacks stay below the reported
    epsilon."""
    settings = settings_of("refresh", "secret", mechanism=mechanism)
    release, divisor = divisors(settings)
    assert release.part.tolist() == [True, False] * 4
    counted = decided(settings, release)
    assert np.flatnonzero(counted).tolist() == [2, 6]  # rounds 3 and 7 counted the canary
    for first, last in ((3, 6), (7, 8)):  # one selection serves R = 2 windows
        assert (release.released[:, first - 1 : last] == release.released[:, [first - 1]]).all()
    std = Z * np.sqrt(REFRESH_SELECTIONS / settings.selection.share)  # B = 1
    per_selection = selection_distance(settings, release)  # its std about 0.01
    assert per_selection == pytest.approx(1 / std, abs=0.035)
    check_heat_noise(settings, release, divisor, std)
    covariance = covariance_of("refresh", mechanism)
    gaussian = canary_distance(settings, covariance)
    assert gaussian <= np.sqrt(1 - settings.selection.share) / Z
    assert np.hypot(gaussian, np.sqrt(REFRESH_SELECTIONS) * per_selection) <= 1.05 / Z
    outcome = audited(release, settings, covariance, counted)
    bounds = {**outcome.bounds, "selection": selection_bound(settings, release)}
    assert outcome.reported == pytest.approx(REPORTED, abs=0.01)
    assert max(bounds.values()) <= outcome.reported, bounds
    assert bounds["likelihood"] > 0.2, bounds
    assert outcome.contribution == pytest.approx(1.0, abs=0.3)
    # the count the distances above measure is the accounting's, min(k_max, S)
    assert settings.selection_count(8) == REFRESH_SELECTIONS < Pattern(2, 0).most(8)


def test_a_canary_only_in_the_unread_windows_changes_no_selection_or_heat() -> None:
    """Rounds 3 and 7 (windows 1 and 3, whose histograms R = 2 never reads) added to a
    canary of rounds 1 and 5 (kept out of windows 1 and 3), on one secret and with the
    heat: every round releases the same
    rows, and every value outside rounds 3 and 7 (noise and sum over the row's noisy heat)
    is the same bit for bit; rounds 3 and 7 differ only on the canary rows they release
    (the canary's update, which the tree's noise covers)."""
    settings = settings_of("refresh", "secret")
    streams = DpStreams("secret", PUBLIC_SEED)
    every = released(settings, True, streams)
    read = released(settings, True, streams, absent=frozenset({3, 4, 7, 8}))
    assert every.part.tolist() == [True, False] * 4
    assert read.part.tolist() == [True, False, False, False] * 2
    assert np.array_equal(every.released, read.released) and every.released.any()
    unread = np.isin(np.arange(1, 9), [3, 7])
    assert np.array_equal(every.values[:, ~unread], read.values[:, ~unread])
    moved = every.values[:, unread] != read.values[:, unread]
    assert moved[:CANARIES].any() and not moved[CANARIES:].any()
    assert np.array_equal(moved[:CANARIES], every.released[:CANARIES][:, unread])


def test_the_refresh_audit_catches_noise_drawn_from_the_published_seed() -> None:
    settings = settings_of("refresh", "seeded")
    release = released(settings)
    outcome = audited(release, settings, covariance_of("refresh"), decided(settings, release))
    assert outcome.bounds["redrawn"] > outcome.reported + 3, outcome.bounds
    assert outcome.bounds["likelihood"] <= outcome.reported, outcome.bounds


# -- max_participations -------------------------------------------------------------------------


@pytest.mark.parametrize("rows", ["all", "private"])
def test_the_max_participations_audit_stays_below_the_reported_epsilon(rows: Rows) -> None:
    setup = f"k2-{rows}"
    settings = settings_of(setup, "secret")
    release = released(settings)
    # every canary asks for all 8 rounds: the bound lets it into k = 2 of them
    assert release.part.tolist() == [True, True] + [False] * 6
    outcome = audited(release, settings, covariance_of(setup))
    assert outcome.reported == pytest.approx(REPORTED, abs=0.01)
    assert max(outcome.bounds.values()) <= outcome.reported, outcome.bounds
    assert outcome.bounds["likelihood"] > 0.2, outcome.bounds
    assert outcome.contribution == pytest.approx(1.0, abs=0.3)
    seeded = settings_of(setup, "seeded")
    caught = audited(released(seeded), seeded, covariance_of(setup))
    assert caught.bounds["redrawn"] > caught.reported + 3, caught.bounds


@pytest.mark.parametrize("rows", ["all", "private"])
def test_the_max_participations_pattern_is_seen_at_the_distance_charged(rows: Rows) -> None:
    """Rounds 1 and 2, the tree's worst case for k = 2 (sens^2 = 14), are what the bound
    lets in: the distance is the tree's share of 1 / z (test_dp_ftrl_audit's check;
    measured 0.46 of 0.5 with rows = "all": Honaker's prefix sums lose a little of what the
    nodes show of two adjacent participations)."""
    setup = f"k2-{rows}"
    settings = settings_of(setup, "secret")
    distance = canary_distance(settings, covariance_of(setup))
    share = settings.selection.share if rows == "private" else 0.0
    assert distance == pytest.approx(np.sqrt(1 - share) / Z, rel=0.1)


def test_a_windowed_round_that_touches_none_of_the_tables_rows_releases_the_window() -> None:
    """A round whose cohort touches no row of the table (here: nobody takes part) still
    releases the window's rows, with their noise only (dp/ftrl.py's window update indexed
    an empty array and raised IndexError; found by the windowed audit)."""
    settings = settings_of("window", "seeded")
    mechanism = built(settings, 200, DpStreams("seeded", PUBLIC_SEED))
    cohorts = [np.arange(100), np.zeros(0, np.int64), np.arange(100), np.zeros(0, np.int64)]
    updates = [
        mechanism.combine(canary_update(members, 100), r).tables["t"]
        for r, members in enumerate(cohorts, start=1)
    ]
    assert len(updates[0].rows) == len(updates[1].rows) == 0  # the first window
    assert len(updates[2].rows) > 0  # the second window's rows, chosen from the first's
    assert torch.equal(updates[3].rows, updates[2].rows)
    assert torch.isfinite(updates[3].values).all() and (updates[3].values != 0).all()


def test_a_run_lets_each_user_in_at_most_max_participations_times(monkeypatch) -> None:
    """The bound the audit drives is the one a run's cohort draw asks (engine/server_round
    .py's ``begin``): with k = 1 no user is drawn twice in the 6 rounds of 50 of 3,000
    (unenforced, about 15 would be)."""
    seen, outcome = drawn_cohorts(
        monkeypatch, ["dp.max_participations=1", "dp.randomness='seeded'"]
    )
    assert len(seen) == 6 and sum(len(c) for c in seen) == 300
    assert np.bincount(np.concatenate(seen)).max() == 1
    dp = outcome.summary["algorithms"]["fedsubavg"]["dp"]
    assert dp["participation"] == {"min_separation": 1, "max_participations": 1}


def test_each_tables_window_selection_is_kept_beside_the_others() -> None:
    """Two tables, windowed: the selection table "a" makes at its window's first round is
    the one its later rounds of the window use, whatever table "b" selects in between (the
    same selection as a mechanism holding "a" alone), and b's is its own."""
    settings = ftrl_settings("ftrl-tree", "private", "seeded", selection=WINDOWED)
    streams = DpStreams("seeded", PUBLIC_SEED)
    inputs = MechanismInputs(settings, {"a": 50, "b": 50}, np.ones(50), False, 1.0, streams)
    both, alone = (MECHANISMS["ftrl-tree"].build(inputs) for _ in range(2))
    assert isinstance(both, FtrlMechanism) and isinstance(alone, FtrlMechanism)
    touched = torch.arange(10, dtype=torch.int64)
    heat = torch.full((10,), 40.0, dtype=torch.float64)  # far above the threshold

    def select(mechanism: FtrlMechanism, table: str, r: int):
        generator = torch.Generator().manual_seed(r)
        return mechanism._window_rows(table, touched, heat, r, lambda: generator)

    for r in (1, 2):  # window 0: gathered, nothing selected
        for table in ("a", "b"):
            select(both, table, r)
        select(alone, "a", r)
    first_a, first_b = select(both, "a", 3), select(both, "b", 3)  # window 1: selected
    assert len(first_a.rows) >= 10 and len(first_b.rows) >= 10
    assert select(both, "a", 4) is first_a and select(both, "b", 4) is first_b
    assert select(alone, "a", 3).rows.tolist() == first_a.rows.tolist()


def two_table_update(members: np.ndarray) -> CohortUpdate:
    """``canary_update``'s members on two tables "a" and "b" with the same rows and values."""
    one = canary_update(members, len(members))
    return dataclasses.replace(
        one,
        rows={"a": one.rows["t"], "b": one.rows["t"]},
        row_owner={"a": one.row_owner["t"], "b": one.row_owner["t"]},
        table_deltas={"a": one.table_deltas["t"], "b": one.table_deltas["t"]},
    )


@pytest.mark.parametrize("rows", ["private", "all"])
def test_a_round_draws_its_selections_from_one_stream_in_table_order(monkeypatch, rows) -> None:
    """The round's selection stream (``round_generator``) is made once a round and read by
    every table in turn: two tables with the same data get different selection noise (one
    fresh stream per table would give both the same noisy heat, noise shared between tables
    that the accounting counts as independent); a dense round makes none."""
    made: list[int] = []

    def counted(seed, round_index):
        made.append(round_index)
        return round_generator(seed, round_index)

    monkeypatch.setattr("fedsub.dp.ftrl.round_generator", counted)
    settings = ftrl_settings("ftrl-tree", rows, "seeded")  # type: ignore[arg-type]
    streams = DpStreams("seeded", PUBLIC_SEED)
    inputs = MechanismInputs(settings, {"a": 50, "b": 50}, np.ones(50), False, 1.0, streams)
    mechanism = MECHANISMS["ftrl-tree"].build(inputs)
    for r in (1, 2, 3):
        update = mechanism.combine(two_table_update(np.arange(20)), r)
        if rows == "private":
            a, b = update.tables["a"], update.tables["b"]
            same = a.rows.tolist() == b.rows.tolist() and torch.equal(a.values, b.values)
            assert not same  # the same data; b's selection read the stream after a's
    assert made == ([1, 2, 3] if rows == "private" else [])
