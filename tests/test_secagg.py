"""Secure aggregation: exact sums, dropouts, what the server sees, malformed messages."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedsub.privacy import shamir
from fedsub.privacy.masks import expand
from fedsub.privacy.secagg import SecAggClient, SecAggError, SecAggServer, secure_sum

LENGTH = 500


def random_vectors(n: int, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        i: rng.integers(0, 2**32, size=LENGTH, dtype=np.uint64).astype(np.uint32) for i in range(n)
    }


def plain_sum(vectors: dict[int, np.ndarray], keep) -> np.ndarray:
    total = np.zeros(LENGTH, dtype=np.uint64)
    for i, v in vectors.items():
        if i in keep:
            total += v
    return (total % 2**32).astype(np.uint32)


def test_shamir_gives_exactly_n_shares_and_takes_only_1_le_t_le_n_and_field_secrets():
    """split: the shares sit at x = 1..n (no more); t from 1 to n and secrets from 0 to
    PRIME - 1 are accepted, both ends included; anything else is refused."""
    for secret, n, t in [(0, 3, 1), (shamir.PRIME - 1, 3, 3), (5, 1, 1)]:
        shares = shamir.split(secret, n=n, t=t)
        assert [x for x, _ in shares] == list(range(1, n + 1))
        assert shamir.reconstruct(shares[:t]) == secret
    for secret, n, t in [(5, 3, 0), (5, 3, 4), (-1, 3, 2), (shamir.PRIME, 3, 2)]:
        with pytest.raises(ValueError):
            shamir.split(secret, n=n, t=t)


def test_shamir_any_t_shares_recover_and_fewer_do_not():
    secret = 123456789123456789
    shares = shamir.split(secret, n=6, t=4)
    assert shamir.reconstruct(shares[:4]) == secret
    assert shamir.reconstruct([shares[5], shares[1], shares[3], shares[0]]) == secret
    assert shamir.reconstruct(shares[:3]) != secret


def test_sum_is_exact_without_dropouts():
    vectors = random_vectors(8)
    total, server = secure_sum(vectors, threshold=5)
    np.testing.assert_array_equal(total, plain_sum(vectors, set(vectors)))
    assert server.rejections == []


@pytest.mark.parametrize("when", ["before", "after"])
def test_sum_survives_n_minus_t_dropouts(when):
    vectors = random_vectors(8, seed=1)
    dropped = [1, 4, 6]  # n - t = 3
    kwargs = {f"drop_{when}_masking": dropped}
    total, _ = secure_sum(vectors, threshold=5, **kwargs)
    counted = set(vectors) - set(dropped) if when == "before" else set(vectors)
    np.testing.assert_array_equal(total, plain_sum(vectors, counted))


def test_fewer_than_t_survivors_stop_with_a_clear_error():
    vectors = random_vectors(6, seed=2)
    with pytest.raises(
        SecAggError,
        match=r"only 3 clients left at masked input collection; "
        r"the threshold is t = 4",
    ):
        secure_sum(vectors, threshold=4, drop_before_masking=[0, 2, 5])
    with pytest.raises(SecAggError, match=r"only 3 clients left at unmasking"):
        secure_sum(vectors, threshold=4, drop_after_masking=[0, 2, 5])


def run_until_masked(vectors, threshold):
    session = b"s" * 16
    clients = {i: SecAggClient(i, threshold, session) for i in vectors}
    server = SecAggServer(threshold, LENGTH, session)
    keys = server.collect_keys(c.advertise() for c in clients.values())
    inboxes = server.route_shares(c.share_keys(keys) for c in clients.values())
    masked = {u: clients[u].masked_input(inboxes[u], vectors[u]) for u in inboxes}
    return clients, server, masked


def test_one_masked_vector_looks_uniform_to_the_server():
    """Chi-square over 16 bins of the top bits of client 0's masked all-zeros vector, pooled
    over runs; the sum of the pairwise masks of a strict subset does not cancel."""
    counts = np.zeros(16)
    for _ in range(20):
        vectors = {i: np.zeros(LENGTH, dtype=np.uint32) for i in range(4)}
        clients, _, masked = run_until_masked(vectors, threshold=3)
        counts += np.bincount(masked[0].values >> 28, minlength=16)
        # self masks removed, a subset of clients still hides its (zero) inputs
        partial = np.zeros(LENGTH, dtype=np.uint32)
        for u in (0, 1):
            partial = partial + masked[u].values - expand(clients[u].self_mask_seed, LENGTH)
        assert np.count_nonzero(partial) > LENGTH * 0.99
        everything = np.zeros(LENGTH, dtype=np.uint32)
        for u in clients:
            everything = everything + masked[u].values - expand(clients[u].self_mask_seed, LENGTH)
        assert not everything.any()  # ... but over all clients the pairwise masks cancel
    expected = counts.sum() / 16
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 37.7  # 99.9% quantile of chi-square with 15 degrees of freedom


def test_wrong_length_and_replayed_messages_are_rejected_naming_the_client():
    vectors = random_vectors(6, seed=3)
    clients, server, masked = run_until_masked(vectors, threshold=4)
    short = dataclasses.replace(masked[2], values=masked[2].values[:-1])
    messages = [masked[0], masked[1], short, masked[3], masked[4], masked[5], masked[4]]
    request = server.collect_masked(messages)
    reasons = {(r.client, r.reason.split(",")[0]) for r in server.rejections}
    assert (2, "masked input must be 500 uint32 values") in reasons
    assert (4, "replayed message") in reasons
    assert request.dropped == (2,)  # treated as dropped: its masks are removed
    responses = [clients[v].unmask(request) for v in request.survivors]
    total = server.finish(request, responses)
    np.testing.assert_array_equal(total, plain_sum(vectors, set(vectors) - {2}))


def test_bad_share_is_named_and_the_sum_still_comes_out():
    vectors = random_vectors(6, seed=4)
    clients, server, masked = run_until_masked(vectors, threshold=3)
    request = server.collect_masked(masked.values())
    responses = [clients[v].unmask(request) for v in request.survivors]
    x, y = responses[1].self_mask_shares[0]
    tampered = dict(responses[1].self_mask_shares)
    tampered[0] = (x, (y + 1) % shamir.PRIME)
    responses[1] = dataclasses.replace(responses[1], self_mask_shares=tampered)
    total = server.finish(request, responses)
    np.testing.assert_array_equal(total, plain_sum(vectors, set(vectors)))
    assert any(r.client == 1 and "bad share of client 0" in r.reason for r in server.rejections)


def test_message_from_another_session_is_rejected():
    vectors = random_vectors(5, seed=5)
    _, server, masked = run_until_masked(vectors, threshold=3)
    foreign = dataclasses.replace(masked[3], session=b"x" * 16)
    server.collect_masked([masked[0], masked[1], masked[2], foreign, masked[4]])
    assert any(
        r.client == 3 and r.reason == "message from another session" for r in server.rejections
    )


def test_client_refuses_to_reveal_both_secrets_of_one_peer():
    vectors = random_vectors(4, seed=6)
    clients, server, masked = run_until_masked(vectors, threshold=3)
    request = server.collect_masked(masked.values())
    evil = dataclasses.replace(request, dropped=(request.survivors[0],))
    with pytest.raises(ValueError, match="both survivor and dropped"):
        clients[1].unmask(evil)


def test_tampered_share_ciphertext_is_caught_by_the_recipient():
    vectors = random_vectors(4, seed=7)
    session = b"s" * 16
    clients = {i: SecAggClient(i, 3, session) for i in vectors}
    server = SecAggServer(3, LENGTH, session)
    keys = server.collect_keys(c.advertise() for c in clients.values())
    inboxes = server.route_shares(c.share_keys(keys) for c in clients.values())
    bad = inboxes[0][2]
    inboxes[0][2] = dataclasses.replace(
        bad, ciphertext=bytes([bad.ciphertext[0] ^ 1]) + bad.ciphertext[1:]
    )
    with pytest.raises(SecAggError, match=f"shares from client {bad.sender} failed authentication"):
        clients[0].masked_input(inboxes[0], vectors[0])


def test_smaller_modulus_sums_mod_2_to_the_bits_and_rejects_larger_inputs():
    rng = np.random.default_rng(8)
    vectors = {i: rng.integers(0, 2**12, size=LENGTH).astype(np.uint32) for i in range(5)}
    total, _ = secure_sum(vectors, threshold=3, modulus_bits=12)
    expected = sum(v.astype(np.int64) for v in vectors.values()) % 2**12
    np.testing.assert_array_equal(total, expected)
    too_big = dict(vectors)
    too_big[2] = too_big[2].copy()
    too_big[2][0] = 2**12
    with pytest.raises(ValueError, match=r"client 2: inputs must lie in \[0, 2\^12\)"):
        secure_sum(too_big, threshold=3, modulus_bits=12)
