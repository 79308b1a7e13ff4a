"""Standard normals by the ziggurat method, one keyed word stream per entry (the Gaussian of
dp/tree_noise.py's noise stream version 2).

Marsaglia and Tsang 2000, "The Ziggurat Method for Generating Random Variables" (Journal of
Statistical Software 5(8)): the half-density f(x) = exp(-x^2 / 2), x >= 0, is covered by
``LAYERS`` = 256 regions of equal area v: a base strip [0, r] x [0, f(r)] together with the
tail beyond r, and 255 rectangles stacked on it. With the paper's r = 3.6541528853610088 for
256 regions, v = r f(r) + integral_r^inf f (the base's area), and the right edges from the
paper's recurrence (its ``zigset``):

    x[255] = r,   x[i] = f^-1(v / x[i + 1] + f(x[i + 1]))   (i = 254 .. 1),
    x[0] = v / f(r)   (the base drawn as one rectangle of area v),

so the top rectangle (layer 1) spans [0, x[1]] x [f(x[1]), 1]. One attempt picks a layer i
and a uniform U in [0, 1): x = U x[i] is accepted at once when x < x[i - 1] (the part of the
layer under the curve; x[0] reads r for the base and 0 for the top layer: ``INNER``). Else, in
a layer i >= 1 (a wedge), x is accepted when f(x[i]) + U' (f(x[i - 1]) - f(x[i])) < f(x) for a
fresh uniform U' (f(x[0]) reads 1), and a new attempt is made when not; in the base (the tail
beyond r) the paper's tail method runs: x = -ln(U1) / r, y = -ln(U2) until 2 y > x^2, and
r + x is returned. The sign is a separate bit. The result is exactly N(0, 1) in distribution,
up to the floating-point grain of U (53 bits).

fedsub's keyed form (not the paper's source of uniforms): each entry has its own stream of
64-bit words W0, W1, W2, ... (dp/tree_noise.py derives them from AES-256 at the entry's own
counters). An attempt is one word: its low 8 bits the layer, bit 8 the sign, its top 53 bits
U (the paper's RNOR takes the layer and U from the same bits of one 32-bit integer, a
correlation Doornik 2005 points out; here the bits are disjoint). The first attempt is W0;
98.5% of entries are accepted there, with one table look-up, one multiplication and one
comparison each (no transcendental function). The others read one block (two words) a step:
after a wedge attempt the block's first word is U' and its second the next attempt (read
only when U' rejects); in the tail its two words are U1 and U2 (a uniform of the auxiliary
kind is (top 52 bits + 1/2) / 2^52, in (0, 1)). So an entry's value is a function of its own
words only, the same drawn alone or among any other entries: the fast path is elementwise
IEEE arithmetic; of the ~1.5% of entries it leaves, the wedges take step 1 vectorised when
they are many (``_step``), and every other step (the tail's from its first: a few entries)
goes one entry at a time in Python (``_one``: the cost of a numpy call is what a small draw
pays), with the same IEEE operations in the same order on both paths, the tail's logarithm
from the C library (``math.log``), and the wedge test
decided as the C library's ``math.exp`` decides it (numpy's exp is used only where its
answer is more than 2^-40 away from the comparison's other side, where the two cannot
disagree). Which path an entry takes depends on how many others are pending; its value does
not.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

__all__ = ["INNER", "LAYERS", "PAPER_R", "PAPER_V", "R", "V", "X", "Y", "normals"]

LAYERS = 256
PAPER_R = 3.6541528853610088  # the paper's r for 256 regions
PAPER_V = 0.00492867323399  # and its v (printed to 12 digits; V below is computed)
R = PAPER_R


def f(x: float) -> float:
    """The unnormalised half-density exp(-x^2 / 2)."""
    return math.exp(-0.5 * x * x)


def tables(r: float = PAPER_R) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
    """(v, x, inner, y) of the ziggurat with base edge ``r`` (module docstring): ``x`` the
    layers' right edges, ``inner`` the edge under which an attempt is accepted at once
    (x[i - 1], r for the base, 0 for the top), ``y[i]`` = f(x[i]) (y[0] = 1, the top of the
    top layer, which the wedge test of layer 1 reads)."""
    v = r * f(r) + math.sqrt(math.pi / 2) * math.erfc(r / math.sqrt(2))
    x = np.empty(LAYERS)
    x[LAYERS - 1] = r
    for i in range(LAYERS - 2, 0, -1):
        x[i] = math.sqrt(-2.0 * math.log(v / x[i + 1] + f(x[i + 1])))
    x[0] = v / f(r)
    inner = np.concatenate([[r, 0.0], x[1 : LAYERS - 1]])
    y = np.array([1.0] + [f(e) for e in x[1:]])
    return v, x, inner, y


V, X, INNER, Y = tables()
SCALE = 2.0**-53
AHEAD = 2  # the blocks of a pending entry read in one call (99.99% end within them)


def _signed(table: np.ndarray) -> np.ndarray:
    """``table`` by the 9 low bits of a word (the layer, then the sign bit): (512,)."""
    return np.concatenate([table, -table])


# by the word's 9 low bits: x = (U 2^53) (+-x[i] / 2^53), one rounding as the paper's wn
# table (the sign exact: rounding is symmetric), and the fast path in integers, U 2^53 <
# INNER / X 2^53 (U x[i] < x[i - 1] up to U's grain)
_WIDTH = _signed(X * SCALE)
_BOUND = np.tile(np.floor(INNER / X * 2.0**53).astype(np.int64), 2)
_DROP = np.concatenate([[0.0], Y[:-1] - Y[1:]])  # f(x[i - 1]) - f(x[i]) of layer i
_LOW = 511
SCALAR = 12  # pending entries up to which ``normals`` takes them one at a time
# the tables as Python floats and ints, for ``_one`` (the same values)
_WIDTH_LIST, _BOUND_LIST = _WIDTH[:256].tolist(), _BOUND[:256].tolist()
_Y_LIST, _DROP_LIST = Y.tolist(), _DROP.tolist()
BAND = 2.0**-40  # ``_below_exp``: numpy's exp and the C library's agree far closer than this

More = Callable[[np.ndarray, int, int], np.ndarray]
"""``more(entries, step, count)``: blocks step .. step + count - 1 (step >= 1) of each of
``entries``' streams, (len(entries), count, 2) uint64 (block k: the words W(2k - 1), W(2k))."""


def normals(first: np.ndarray, more: More) -> np.ndarray:
    """One standard normal per entry from its stream: ``first`` (n,) uint64 its W0, ``more``
    its later blocks (read only for the ~1.5% not accepted at once): (n,) float64."""
    out = np.empty(len(first))
    pending = accepted(first, out)
    finish(out, pending, first[pending], more)
    return out


def accepted(first: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The fast path of ``normals``: each entry's first attempt x into ``out`` (n,) float64,
    and the entries not accepted at once (their x is not their value: ``finish``)."""
    low = np.bitwise_and(first.view(np.int64), _LOW)
    high = (first >> np.uint64(11)).view(np.int64)
    # float(high) * width, the integer converted exactly (high < 2^53) inside the product
    np.multiply(high, _WIDTH.take(low), out=out)
    return np.flatnonzero(high >= _BOUND.take(low))


def finish(out: np.ndarray, pending: np.ndarray, words: np.ndarray, more: More) -> None:
    """The values of the ``pending`` entries (``accepted``'s; ``words`` their W0s) into
    ``out``: whichever entries of a draw are pending together, each value is its own."""
    if len(pending) > SCALAR:
        out[pending] = _step(words, out[pending], pending, more)
    elif len(pending):  # a few: each entry's value straight into ``out`` (``_one``)
        entries = pending.tolist()
        blocks = more(pending, 1, AHEAD).tolist()
        for word, its, entry in zip(words.tolist(), blocks, entries, strict=True):
            out[entry] = _one(word, its, 1, entry, more)


def _step(attempt: np.ndarray, x: np.ndarray, entries: np.ndarray, more: More) -> np.ndarray:
    """Step 1 of the pending wedges, vectorised, from block 1: its U' for the wedge test and,
    when that rejects, its second word as the next attempt. The entries it does not end go on
    one at a time (``_one``): a rejected wedge from block 2, and the tail (about 2% of the
    pending entries: a few) from block 1, its U1 and U2 (the same steps, in Python)."""
    blocks = more(entries, 1, AHEAD)  # block 2 too: the entries step 1 does not end read it
    block = blocks[:, 0]
    layer = np.bitwise_and(attempt.view(np.int64), 255)
    u = np.add(block[:, 0] >> np.uint64(12), 0.5)  # _uniform
    u *= 2.0**-52
    wedge = layer > 0
    ends = _below_exp(Y.take(layer) + u * _DROP.take(layer), x) & wedge
    fresh = block[:, 1]
    low = np.bitwise_and(fresh.view(np.int64), _LOW)
    high = (fresh >> np.uint64(11)).view(np.int64)
    out = np.where(ends, x, high.astype(np.float64) * _WIDTH.take(low))
    ends |= (high < _BOUND.take(low)) & wedge  # a new attempt accepted at once
    left = np.flatnonzero(~ends)
    if len(left):  # a wedge goes on with its new attempt from block 2, the tail from block 1
        rejected = wedge[left].tolist()
        words = np.where(wedge[left], fresh[left], attempt[left]).tolist()
        read = blocks[left].tolist()
        at = entries[left].tolist()
        out[left] = [
            _one(word, its[1:], 2, entry, more) if later else _one(word, its, 1, entry, more)
            for word, its, entry, later in zip(words, read, at, rejected, strict=True)
        ]
    return out


def _one(attempt: int, blocks: list[list[int]], step: int, entry: int, more: More) -> float:
    """One entry's steps from block ``step`` on (``blocks`` its blocks step, step + 1, ...
    read so far; later ones from ``more``), its attempt ``attempt`` not accepted at once:
    the paper's nfix, a step a block."""
    word, tail, at = attempt, (attempt & 255) == 0, 0
    while True:
        if at == len(blocks):
            blocks = blocks + more(np.array([entry]), step + at, AHEAD).tolist()[0]
        aux, fresh = blocks[at]
        at += 1
        if tail:  # x = -ln U1 / r, y = -ln U2 until 2 y > x^2; r + x
            t = -math.log(_uniform(aux)) / R
            y = -math.log(_uniform(fresh))
            if y + y > t * t:
                return _with_sign(R + t, word)
            continue
        layer = word & 255
        x = float(word >> 11) * _WIDTH_LIST[layer]
        if _Y_LIST[layer] + _uniform(aux) * _DROP_LIST[layer] < math.exp(-0.5 * x * x):
            return _with_sign(x, word)
        word, layer = fresh, fresh & 255
        if fresh >> 11 < _BOUND_LIST[layer]:
            return _with_sign(float(fresh >> 11) * _WIDTH_LIST[layer], fresh)
        tail = layer == 0


def _uniform(word: int) -> float:
    """A uniform in (0, 1) from a word's top 52 bits: (k + 1/2) / 2^52 (exact)."""
    return (float(word >> 12) + 0.5) * 2.0**-52


def _with_sign(value: float, word: int) -> float:
    return -value if word >> 8 & 1 else value


def _below_exp(value: np.ndarray, x: np.ndarray) -> np.ndarray:
    """value < exp(-x^2 / 2) elementwise, as the C library's exp decides it (``_one``'s):
    numpy's exp, and the C library's where the two sides are within ``BAND`` (never seen)."""
    bound = np.exp(-0.5 * x * x)
    below = value < bound
    close = np.abs(value - bound) <= BAND * bound
    if close.any():
        pairs = zip(value[close].tolist(), x[close].tolist(), strict=True)
        below[close] = [v < math.exp(-0.5 * e * e) for v, e in pairs]
    return below
