"""Distributed differential privacy over secure aggregation (``privacy.level = "full"``): each
client clips its update, encodes it in the secure sum's integers and adds its *share* of
discrete Gaussian noise, so the server only ever decodes the noised sum (Kairouz, Liu and
Steinke 2021, "The distributed discrete Gaussian mechanism for federated learning with secure
aggregation", in fedsub's form: no random rotation, a stated wrap-around bound instead).

One round, in integers mod 2^32 (``numerics/fixed_point.py``'s two's complement):

- the client's vector x (its row deltas over the round's public row slots and its dense deltas,
  length d) is clipped to L2 norm C and times its capped weight w <= 1, scaled by s (a power
  of two) and rounded to the nearest integer: ||round(s x)|| <= Delta = C s + sqrt(d) / 2
  (each coordinate moves by at most 1/2);
- it adds d independent N_Z(0, sigma_share^2) (dp/discrete_gaussian.py) with
  sigma_share = z Delta / sqrt(K_min): any K' >= K_min surviving shares sum to noise of
  variance about K' sigma_share^2 >= (z Delta)^2;
- secure aggregation (threshold t >= K_min: fewer survivors cannot be unmasked) gives the server
  the sum only; it decodes it (signed, over s) and divides by the public denominator D.

Privacy (``round_event``): Kairouz et al. 2021 (Proposition 14 of the arXiv version) bound
the Renyi divergence of order alpha between the sums of n >= K_min independent
N_Z(0, sigma^2) shares added to integer vectors at L2 distance Delta_2 by
alpha Delta_2^2 / (2 n sigma^2) + tau d, tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1))
(their Theorem 1 gives the same in the form sqrt(Delta_2^2 / (n sigma^2) + tau d / 2) of a
concentrated-DP epsilon). Fixed-size cohorts have replace-one neighbours: Delta_2 = 2 Delta, so
with n >= K_min the bound is at most alpha 2 / z^2 + tau d. fedsub requires
sigma_share >= ``SHARE_STD_FLOOR``, bounds tau d for every K, d < 2^32 by ``slack`` (below
1e-1000: zero in double precision) and composes one ``ZCDpEvent(rho = 2 / z^2 + slack,
xi = slack)`` per round (RDP alpha rho + xi, which covers both forms), *without* sampling
amplification: dp-accounting's RDP accountant amplifies only Gaussian events by sampling, and a
sum of discrete Gaussians is not one, so fedsub does not claim the amplification (epsilon is
larger than the central mechanism's at the same z; docs: Differential privacy).

Wrap-around: s is the largest power of two with
K (C s + 1/2) + TAIL_STDS sqrt(K / K_min) z Delta < 2^31: the clients' values cannot wrap, and
the noise (sqrt(K') sigma_share-subgaussian, Canonne et al. 2020) wraps a coordinate with
probability at most 2 exp(-TAIL_STDS^2 / 2) ~ 5.5e-43.

``noisy_share`` is the client's whole part, a pure function of its vector, its weight, the
round's public ``DiscreteNoise`` and its own random generator (a Flower node calls it with its
own secret randomness; the simulator seeds one per (seed, round, client)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import dp_accounting
import numpy as np

from fedsub.dp import discrete_gaussian
from fedsub.dp.randomness import DpStreams
from fedsub.numerics import seeding
from fedsub.numerics.fixed_point import MODULUS_BITS, SIGNED_LIMIT, FixedPoint

TAIL_STDS = 14.0  # the noise's wrap-around margin, in its standard deviations
SHARE_STD_FLOOR = 16.0  # sigma_share >= this keeps Kairouz et al.'s tau below 1e-1000
LARGEST = 2**32  # K, d below this (slack's bound)


def slack(cohort: int) -> float:
    """An upper bound on tau d for sigma >= SHARE_STD_FLOOR, n <= ``cohort`` and any d < 2^32:
    exp(-2 pi^2 sigma^2 k / (k + 1)) <= exp(-pi^2 sigma^2) for k >= 1, so
    tau <= 10 (n - 1) exp(-pi^2 SHARE_STD_FLOOR^2) (zero in double precision)."""
    return 10.0 * (cohort - 1) * math.exp(-(math.pi**2) * SHARE_STD_FLOOR**2) * LARGEST


def round_event(noise_multiplier: float, cohort: int) -> dp_accounting.ZCDpEvent:
    """One round's event for replace-one neighbours (module docstring)."""
    extra = slack(cohort)
    return dp_accounting.ZCDpEvent(2.0 / noise_multiplier**2 + extra, xi=extra)


@dataclass(frozen=True)
class DiscreteNoise:
    """A round's public encoding and noise: clip C, scale s, the vector length d and each
    share's sigma (integer units)."""

    clip: float
    scale: float
    length: int
    share_std: float

    @property
    def sensitivity(self) -> float:
        """Delta: the L2 norm bound of one client's rounded vector, C s + sqrt(d) / 2."""
        return self.clip * self.scale + math.sqrt(self.length) / 2

    @property
    def coding(self) -> FixedPoint:
        """The fixed point the server decodes the sum with (values in [-C, C] times s)."""
        return FixedPoint(self.clip, self.scale)

    def share(self, values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """A member's noisy share (uint32) of its real values (unweighted: weight 1, uniform
        weights), what it puts in a secure sum's real slots (privacy/sparse_secagg.py's
        ``noised_input``). In process and on a Flower node, on the member's side."""
        return noisy_share(values, 1.0, self, rng)

    @staticmethod
    def for_round(
        clip: float, noise_multiplier: float, cohort: int, min_survivors: int, length: int
    ) -> DiscreteNoise:
        """The largest power-of-two scale whose sum of ``cohort`` clients and noise cannot wrap
        (module docstring), and sigma_share = z Delta / sqrt(K_min) at it."""
        z, k, k_min = noise_multiplier, cohort, min_survivors
        if not 1 <= k_min <= k < LARGEST or not 1 <= length < LARGEST:
            raise ValueError(
                f"need 1 <= min_survivors <= cohort < 2^32 and 1 <= length < 2^32, got "
                f"{k_min}, {k}, {length}"
            )
        margin = TAIL_STDS * math.sqrt(k / k_min) * z
        room = SIGNED_LIMIT - 1 - k / 2 - margin * math.sqrt(length) / 2
        if room <= 0:
            raise ValueError(
                f"a cohort of {k} with noise multiplier {z:g} over {length} values cannot fit "
                "the secure sum's 32 bits; use fewer clients, values or a smaller multiplier"
            )
        scale = 2.0 ** math.floor(math.log2(room / (clip * (k + margin))))
        noise = DiscreteNoise(clip, scale, length, 0.0)
        share_std = z * noise.sensitivity / math.sqrt(k_min)
        if share_std < SHARE_STD_FLOOR:
            raise ValueError(
                f"each client's noise share would have sigma {share_std:.3g} < "
                f"{SHARE_STD_FLOOR:g} integer units (noise multiplier {z:g}, scale {scale:g}); "
                "use a larger noise multiplier"
            )
        return DiscreteNoise(clip, scale, length, share_std)


def clipped_integers(values: np.ndarray, weight: float, noise: DiscreteNoise) -> np.ndarray:
    """round(s * w * x * min(1, C / ||x||)) (int64): the client's update before its noise."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) != noise.length:
        raise ValueError(f"a client vector of {len(x)} values, the round lays out {noise.length}")
    if not np.isfinite(x).all():
        raise ValueError("cannot encode NaN or Inf for secure aggregation")
    if not 0 <= weight <= 1:
        raise ValueError(f"a client's weight must be in [0, 1], got {weight}")
    norm = float(np.linalg.norm(x))
    factor = weight * min(1.0, noise.clip / norm) if norm > 0 else 0.0
    return np.rint(x * (factor * noise.scale)).astype(np.int64)


def noisy_share(
    values: np.ndarray, weight: float, noise: DiscreteNoise, rng: np.random.Generator
) -> np.ndarray:
    """A client's input to the secure sum (uint32 mod 2^32): its vector clipped to L2 norm C,
    times its weight, in fixed point, plus its share of N_Z(0, sigma_share^2) per value."""
    integers = clipped_integers(values, weight, noise)
    integers += discrete_gaussian.sample(noise.share_std, len(integers), rng)
    return (integers % 2**MODULUS_BITS).astype(np.uint32)


def member_rng(seed: seeding.Seed, round_index: int, client: int) -> np.random.Generator:
    """The simulator's stand-in for a client's secret randomness in a round, keyed by the
    run's secret (``seed``; train.seed under dp.randomness = "seeded", so runs repeat); a
    deployed node uses its own."""
    return seeding.rng(seed, seeding.DP, round_index, 1 + client)


@dataclass(frozen=True)
class DistributedDp:
    """[dp] at privacy.level "full": its part in a round's secure row sum, in process and on
    Flower's server (privacy/private_rounds.py's ``NoisySum``). The public settings: clip C,
    noise multiplier z, the fewest survivors K_min a sum may be decoded from, the public
    denominator K; and the key of the members' shares in process (``member_rng`` over
    ``streams``' secret, or ``seed`` without streams; a Flower node draws its own)."""

    clip: float
    noise_multiplier: float
    min_survivors: int  # K_min
    denominator: int  # K: the decoded sum is divided by it
    seed: int = 0
    streams: DpStreams | None = None

    def noise(self, members: int, length: int) -> DiscreteNoise:
        """The round's public noise for a sum of ``members`` over ``length`` real values."""
        z, k_min = self.noise_multiplier, self.min_survivors
        return DiscreteNoise.for_round(self.clip, z, members, k_min, length)

    def threshold(self, majority: int) -> int:
        """A secure sum's threshold: the ``majority`` raised to K_min, so no sum with less
        noise than accounted is ever decoded."""
        return max(majority, self.min_survivors)

    def generator(self, round_index: int, member: int) -> np.random.Generator:
        """Member ``member``'s generator in round ``round_index`` (in process)."""
        key = self.seed if self.streams is None else self.streams.key
        return member_rng(key, round_index, member)


@dataclass(frozen=True)
class NodeNoise:
    """Distributed DP as a Flower node's copy of the run config states it ([dp] at level
    ``full``): the least noise it adds, the fewest survivors it lets a sum be unmasked from,
    and where its shares come from: its own secret randomness, or (``seeded``, run config
    ``dp-seeded-noise``) the in-process run's generator ``member_rng(seed, round, client)``,
    so a Flower run repeats the in-process numbers, but whoever knows the seed can redraw the
    shares (docs, Differential privacy, "Where it runs and whom you trust"). Its refusals
    are ``ValueError``s; privacy/secure_rows_protocol.py reads the server's requests and
    names the node."""

    clip: float
    noise_multiplier: float | None  # None: calibrated by the server for a target epsilon
    min_survivors: int  # K_min
    seed: int
    client: int
    seeded: bool = False

    def generator(self, round_index: int) -> np.random.Generator:
        """The generator of this node's share in round ``round_index``."""
        if self.seeded:
            return member_rng(self.seed, round_index, self.client)
        return np.random.default_rng()  # fresh entropy from the operating system

    def check_threshold(self, threshold: int) -> None:
        """Refuse to take part in a secure sum whose threshold is below K_min: its sum could
        be unmasked from fewer noise shares than the accounted noise needs."""
        if threshold < self.min_survivors:
            raise ValueError(
                f"the server asks for a secure sum with threshold {threshold}, below "
                f"dp.min_survivors K_min = {self.min_survivors}; refusing"
            )

    def round_noise(
        self, clip: float, noise_multiplier: float, min_survivors: int, clients: int, length: int
    ) -> DiscreteNoise:
        """The round's public ``DiscreteNoise`` from the server's numbers, refused when they
        ask for less noise than this node's config states."""
        z, k_min = noise_multiplier, min_survivors
        weaker = [
            (clip != self.clip, f"dp.clip {clip:g}, this node's is {self.clip:g}"),
            (
                self.noise_multiplier is not None and z < self.noise_multiplier,
                f"noise multiplier {z:g} below this node's {self.noise_multiplier}",
            ),
            (k_min < self.min_survivors, f"K_min {k_min} below this node's {self.min_survivors}"),
        ]
        for condition, what in weaker:
            if condition:
                raise ValueError(f"the server's round settings ask for {what}; refusing")
        return DiscreteNoise.for_round(clip, z, clients, k_min, length)
