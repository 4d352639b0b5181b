"""``state_sync.fingerprints_once``: at a pass start with a cache over worker processes, the cache
front and the state tracker fingerprint the source's attributes once between them, not twice (a CRC-32
of every large writable array), and a change is still seen by both."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import kerasfeed
from kerasfeed.execution import state_sync
from kerasfeed.execution.state_sync import fingerprint, fingerprints_once

BIG = 1 << 20  # bytes: far above the size compared by content (64 KB), so CRC-32'd


class _CountingZlib:
    def __init__(self):
        self.crc_calls = 0

    def crc32(self, data, *args):
        self.crc_calls += 1
        return zlib.crc32(data, *args)


@pytest.fixture
def crcs(monkeypatch):
    counting = _CountingZlib()
    monkeypatch.setattr(state_sync, "zlib", counting)
    return counting


def test_an_object_is_fingerprinted_once_inside_the_scope_and_every_time_outside(crcs):
    a = np.zeros(BIG // 8)
    fingerprint(a), fingerprint(a)
    assert crcs.crc_calls == 2
    with fingerprints_once():
        first = fingerprint(a)
        with fingerprints_once():  # nested: the outer scope's
            assert fingerprint(a) is first
        assert fingerprint(a) is first
        b = a.copy()  # the same content, another object: its own
        assert fingerprint(b) == first and fingerprint(b) is not first
    assert crcs.crc_calls == 4
    assert state_sync._TAKEN.memo is None
    a[0] = 1.0  # a change between two scopes is seen
    with fingerprints_once():
        assert fingerprint(a) != first
    assert crcs.crc_calls == 5


def test_the_scope_is_left_clean_when_its_body_raises(crcs):
    a = np.zeros(BIG // 8)
    with pytest.raises(RuntimeError), fingerprints_once():
        fingerprint(a)
        raise RuntimeError("boom")
    assert state_sync._TAKEN.memo is None
    fingerprint(a)
    assert crcs.crc_calls == 2


class _Holding(kerasfeed.SceneSequence):
    """A source holding a large writable array (an in-memory dataset); ``bump_after`` changes it after a pass."""

    cache_ignores = ("passes",)  # a count the hook keeps: not read by the stored stage

    def __init__(self, bump_after=None):
        super().__init__()
        self.table = np.arange(BIG // 8, dtype=np.float64)
        self.bump_after = bump_after
        self.passes = 0

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return self.table[i * 4:(i + 1) * 4].copy()

    def on_epoch_end(self):
        self.passes += 1
        if self.bump_after is not None and self.passes == self.bump_after:
            self.table[0] += 1.0


def test_a_cached_pass_start_on_worker_processes_fingerprints_the_source_once(crcs):
    seq = _Holding()
    passes = 4
    with kerasfeed.to_loader(seq, batch_size=2, shuffle=True, seed=0, executor="processes", workers=1,
                             cache="memory") as loader:
        got = [[b.copy() for b in loader] for _ in range(passes)]
    want = [np.sort(np.concatenate(p).ravel()) for p in got]
    assert all(np.array_equal(w, np.arange(24, dtype=np.float64)) for w in want)
    # The state tracker's baseline when the workers get the source, then one CRC-32 of `table` a pass
    # start, shared by the cache front and the tracker (two a pass start before fingerprints_once).
    assert crcs.crc_calls == 1 + passes, crcs.crc_calls


def test_a_change_of_the_cached_source_is_still_refused_by_name(crcs):
    seq = _Holding(bump_after=1)
    with kerasfeed.to_loader(seq, batch_size=2, executor="processes", workers=1, cache="memory") as loader:
        assert len(list(loader)) == 3
        with pytest.raises(ValueError, match="attribute `table` changed since the last pass"):
            list(loader)
