"""Seeded bijections over ``[0, n)`` and counter-based uniforms, computed per position (TF-free).

What every built-in order computes its passes with: the entry at position ``p`` of pass ``e`` is a
pure function of ``(seed, e, p)``, evaluated for a window of positions at once with ``uint64`` numpy
arithmetic (no Python call per index), so no pass is ever held whole.

NOTE [ A Feistel network with cycle-walking ]
``permute(x, n, key)`` is a keyed permutation of ``[0, n)``. It runs a Feistel network on pairs
``(L, R)`` in ``[0, a) x [0, b)`` with ``a = ceil(sqrt(n))``, ``b = ceil(n / a)`` (the value
``L * b + R``): each of ``ROUNDS`` rounds maps ``(L, R)`` to ``(R, (L + F_r(R)) mod a)`` (the two widths
then trade places), with ``F_r`` a 64-bit mixing function (SplitMix64's finalizer) of ``R`` and a round
key drawn from ``key``, reduced to ``[0, a)`` by a multiply-shift. Every round is invertible whatever
``F_r`` is, so the network is a bijection of ``[0, a * b)``; with a pseudorandom ``F_r`` and 4 or more
rounds it is a pseudorandom permutation (Luby-Rackoff; the same modular form as the FF1
format-preserving cipher). A value that lands at ``n`` or beyond (``a * b - n < a`` values can) is sent
through the network again (cycle-walking) until it lands inside: that restricts the bijection of
``[0, a * b)`` to one of ``[0, n)``. Walks are rare (a fraction below ``1 / sqrt(n)``) and short.
Memory: a few arrays the size of the window, whatever ``n`` is. Only ``uint64`` numpy operations are
used (a division by a scalar is fast in numpy; a remainder is not, so ``R = x - (x // b) * b``).
Quality (every index exactly once, no correlation between passes or seeds, fixed points and
displacements as in a uniform permutation) is tested in ``tests/test_index_space.py``;
``docs/sampling.md`` has the figures.

NOTE [ Small domains are shuffled exactly ]
Over a few items a Feistel network is measurably far from a uniform permutation (the round functions
are too few to reach every permutation evenly: at ``n = 6`` some permutations came 3.4x as often as
others, and up to ``n`` of a hundred or so neighbouring items landed next to each other ~3 % too
often). Domains of at most ``SMALL_N`` values are therefore shuffled by a table: ``table(n, seed,
*words)`` is ``numpy.random.default_rng([seed, *words]).permutation(n)`` (the same key inputs as
``derive_key``), an exactly uniform permutation that is still a pure function of its arguments. Tables
are kept in a small LRU cache (``TABLE_BUDGET`` entries over all tables, 2 bytes each, at most
``MAX_TABLES`` tables) so that the windows of one pass share theirs; larger domains keep the Feistel
network (nothing per pass).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any, Union

import numpy as np

ROUNDS = 6
MAX_N = 2**62
# Domains up to this size are shuffled by an exact table (see the NOTE).
SMALL_N = 2**16
# Entries kept over all cached tables (uint16: 2 bytes each, 8 MiB in all), and tables.
TABLE_BUDGET = 2**22
MAX_TABLES = 4096
_SHIFT = np.uint64(32)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_ONE = np.uint64(1)
# Makes the round keys of one key differ (odd 64-bit constants).
_ROUND_SALT = [np.uint64((0xD1B54A32D192ED03 * (r + 1)) & (2**64 - 1)) for r in range(ROUNDS)]

UIntLike = Union[np.uint64, np.ndarray]


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a ``uint64`` array (a bijection of 64-bit words, strong avalanche)."""
    x = x ^ (x >> np.uint64(30))
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def derive_key(seed: int, *words: int) -> np.uint64:
    """A 64-bit key from a seed and stream/pass numbers (``numpy.random.SeedSequence``)."""
    state = np.random.SeedSequence([int(seed), *(int(w) for w in words)]).generate_state(1, np.uint64)
    return np.uint64(state[0])


def subkeys(key: UIntLike, *words: Any) -> np.ndarray:
    """Keys derived from ``key`` and per-element words (arrays broadcast), e.g. one per (class, cycle)."""
    out = np.asarray(key, dtype=np.uint64).copy() if np.ndim(key) else np.full(1, key, dtype=np.uint64)
    for w in words:
        out = mix64((out ^ (np.asarray(w).astype(np.uint64) * _GOLDEN)) + _GOLDEN)
    return out


def domain(n: int) -> tuple[int, int]:
    """``(a, b)``: the Feistel network's pairs for ``n`` values (``a * b >= n``, ``a >= b``)."""
    n = int(n)
    if not 1 <= n <= MAX_N:
        raise ValueError(f"A seeded bijection covers 1 to 2^62 items. Received: n={n}")
    a = math.isqrt(n - 1) + 1
    return a, -(-n // a)


def uniforms(key: np.uint64, positions: np.ndarray) -> np.ndarray:
    """Uniform floats in ``[0, 1)``, one per position: SplitMix64 of ``(key, position)``."""
    x = np.asarray(positions).astype(np.uint64) + _ONE
    x *= _GOLDEN
    x += np.uint64(key)
    return (mix64(x) >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


_tables: "OrderedDict[tuple, np.ndarray]" = OrderedDict()
_tables_size = 0
_tables_lock = threading.Lock()


def draw_table(n: int, seed: int, *words: int) -> np.ndarray:
    """What ``table`` caches: ``default_rng([seed, *words]).permutation(n)`` as ``uint16``."""
    if not 1 <= int(n) <= SMALL_N:
        raise ValueError(f"An exact permutation table covers 1 to {SMALL_N} items. Received: n={n}")
    return np.random.default_rng([int(seed), *(int(w) for w in words)]).permutation(int(n)).astype(np.uint16)


def table(n: int, seed: int, *words: int) -> np.ndarray:
    """The exactly uniform permutation of ``[0, n)`` (``n <= SMALL_N``) drawn from ``(seed, *words)``: a
    read-only ``uint16`` array, cached (see the NOTE)."""
    global _tables_size
    key = (int(n), int(seed), *(int(w) for w in words))
    with _tables_lock:
        found = _tables.get(key)
        if found is not None:
            _tables.move_to_end(key)
            return found
    out = draw_table(*key)
    out.setflags(write=False)
    with _tables_lock:
        if key not in _tables:
            _tables[key] = out
            _tables_size += out.size
            while (_tables_size > TABLE_BUDGET or len(_tables) > MAX_TABLES) and len(_tables) > 1:
                _tables_size -= _tables.popitem(last=False)[1].size
    return out


def shuffled(positions: Any, n: int, seed: int, *words: int) -> np.ndarray:
    """The images of ``positions`` under the permutation of ``[0, n)`` drawn from ``(seed, *words)``: an
    exact table up to ``SMALL_N`` values, the Feistel bijection keyed by ``derive_key(seed, *words)`` beyond."""
    if int(n) <= SMALL_N:
        return table(n, seed, *words)[np.asarray(positions).reshape(-1)].astype(np.int64)
    return permute(positions, n, derive_key(seed, *words))


def _network(x: np.ndarray, a: Any, b: Any, round_keys: list) -> np.ndarray:
    # One pass of x = L * b + R through the Feistel network (see the NOTE).
    for k in round_keys:
        left = x // b
        right = x - left * b
        f = mix64(right ^ k)
        f >>= _SHIFT  # 32 random bits ...
        f *= a
        f >>= _SHIFT  # ... times a: uniform in [0, a) (a < 2^32)
        f += left
        f = np.where(f >= a, f - a, f)
        right *= a
        right += f
        x = right
        a, b = b, a
    return x


def _take(param: Any, todo: np.ndarray) -> Any:
    return param[todo] if isinstance(param, np.ndarray) and param.ndim else param


def permute(positions: Any, n: Any, key: Any, *, pairs: Any = None) -> np.ndarray:
    """The images of ``positions`` under the keyed bijection of ``[0, n)``.

    Args:
        positions: integers in ``[0, n)`` (an array; any shape is flattened).
        n: the domain size: an int, or one per position (an array).
        key: a ``uint64`` key (``derive_key``), or one per position.
        pairs: ``(a, b)`` arrays, one entry per position, when ``n`` is an
            array (``domain`` of each position's ``n``); computed when None.

    Returns:
        An int64 array: a permutation of ``[0, n)`` when ``positions`` are
        ``0 .. n-1``, a pure function of ``(key, n, position)``.
    """
    x = np.asarray(positions).reshape(-1).astype(np.uint64)
    if np.ndim(n):
        n_u = np.asarray(n).astype(np.uint64)
        if pairs is None:
            values, inverse = np.unique(n_u, return_inverse=True)
            table = np.array([domain(int(v)) for v in values], dtype=np.uint64).reshape(-1, 2)
            pairs = (table[inverse.reshape(-1), 0], table[inverse.reshape(-1), 1])
        a, b = (np.asarray(p).astype(np.uint64) for p in pairs)
    else:
        if int(n) == 1:
            return np.zeros(len(x), dtype=np.int64)
        n_u = np.uint64(n)
        a, b = (np.uint64(p) for p in domain(int(n)))
    if np.ndim(key):
        keys = np.asarray(key).astype(np.uint64)
        round_keys = [mix64(keys ^ salt) for salt in _ROUND_SALT]
    else:
        round_keys = [mix64(np.full(1, np.uint64(key) ^ salt, dtype=np.uint64))[0] for salt in _ROUND_SALT]
    out = _network(x, a, b, round_keys)
    todo = np.flatnonzero(out >= n_u)
    while todo.size:  # cycle-walking: only the values that landed outside go again
        y = _network(out[todo], _take(a, todo), _take(b, todo), [_take(k, todo) for k in round_keys])
        out[todo] = y
        todo = todo[y >= _take(n_u, todo)]
    return out.astype(np.int64)


__all__ = [
    "MAX_N", "ROUNDS", "SMALL_N", "TABLE_BUDGET", "derive_key", "domain", "draw_table", "mix64", "permute",
    "shuffled", "subkeys", "table", "uniforms",
]
