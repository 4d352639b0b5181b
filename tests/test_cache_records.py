"""The item store's records alone (kerasfeed/cache/records.py, store.py): written with pwritev, read as views."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kerasfeed.cache import records
from kerasfeed.cache.store import ItemStore


def _odd_item() -> dict:
    rng = np.random.default_rng(0)
    big = rng.random((32, 64, 64, 3), dtype=np.float32)
    return {
        "strided": big[:, ::3, 1::2],  # not contiguous: written from a contiguous copy
        "fortran": np.asfortranarray(rng.random((5, 7))),
        "when": np.array(["2026-11-25T20:00", "1970-01-01T00:00"], dtype="datetime64[m]"),
        "record": np.array([(1, 2.5), (3, -1.0)], dtype=[("a", "<i4"), ("b", ">f8")]),
        "scalar": np.array(7, np.int16),
        "big": big,
        "text": "kept inline",
        "many": [np.full(k % 5 + 1, k, np.uint16) for k in range(700)],  # more buffers than one pwritev takes
    }


def _assert_same(got: dict, want: dict) -> None:
    for key in ("strided", "fortran", "when", "record", "scalar", "big"):
        assert got[key].dtype == want[key].dtype, key
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert got["text"] == want["text"]
    assert len(got["many"]) == 700
    for a, b in zip(got["many"], want["many"]):
        np.testing.assert_array_equal(a, b)


def test_a_record_written_with_pwritev_reads_back_equal_and_aligned():
    item = _odd_item()
    store = ItemStore.memory(4, 64 * 2**20)
    try:
        assert store.put(2, item)
        got = store.get(2)
        _assert_same(got, item)
        assert got["big"].ctypes.data % 64 == 0 and not got["big"].flags.writeable  # a view of the store
        assert store.get(1) is None and store.get(3) is None
    finally:
        store.close()


def test_short_writes_go_on_where_they_stopped(monkeypatch):
    """A pwritev that writes less than asked (a signal, a full device's last bytes) is resumed, not lost."""
    real, calls = os.pwritev, []

    def at_most_4099_bytes(fd, buffers, offset):
        left, head = 4099, []
        for b in buffers:
            b = memoryview(b).cast("B")
            head.append(b[:left])
            left -= len(head[-1])
            if left <= 0:
                break
        calls.append(len(buffers))
        return real(fd, head, offset)

    monkeypatch.setattr(records.os, "pwritev", at_most_4099_bytes)
    item = _odd_item()
    store = ItemStore.memory(1, 64 * 2**20)
    try:
        assert store.put(0, item)
        _assert_same(store.get(0), item)
        assert len(calls) > 384  # 1.5 MB in writes of 4 KB at most
    finally:
        store.close()


def test_a_write_that_makes_no_progress_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setattr(records.os, "pwritev", lambda fd, buffers, offset: 0)
    store = ItemStore.memory(1, 2**20)
    try:
        with pytest.raises(OSError, match="pwritev wrote nothing at offset"):
            store.put(0, np.ones(10))
        assert store.get(0) is None  # never published
    finally:
        store.close()


def test_a_writer_holding_the_store_fd_keeps_it_past_close():
    """close() while a writer holds the data file's fd: the fd stays that file's until the writer lets go."""
    store = ItemStore.memory(2, 2**20)
    assert store.put(0, np.arange(4.0))
    held = store._writable()
    fd = held.fd
    store.close()
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kerasfeed-cache-data")
    del held
    assert not os.path.exists(f"/proc/self/fd/{fd}") or "kerasfeed-cache" not in os.readlink(f"/proc/self/fd/{fd}")


def test_a_record_whose_header_or_spec_points_past_it_is_not_served(tmp_path):
    """A flipped bit in a kept record's ``arrays_at`` or in its spec's shape served garbage floats or an array
    reaching into the next record, with no warning (a helper's report); the record is now refused (made again)."""
    import pickle

    record = records.encode_record(1, np.ones((4, 16), np.float32))
    path = str(tmp_path / "data")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        records.write_record(fd, 0, 1, record)
        records.write_record(fd, record.length, 2, records.encode_record(2, np.full((4, 16), 2.0, np.float32)))
    finally:
        os.close(fd)
    buf = bytearray(open(path, "rb").read())  # the next record's bytes after it
    assert np.array_equal(records.read_record(bytes(buf), 0, 1, record.length), np.ones((4, 16)))
    magic, spec_length, index, length, arrays_at = records.HEADER.unpack_from(buf, 0)
    past = bytearray(buf)
    records.HEADER.pack_into(past, 0, magic, spec_length, index, length, length + 64)  # its arrays past its end
    assert records.read_record(bytes(past), 0, 1, record.length) is None
    spec = pickle.loads(bytes(buf[records.HEADER_SIZE : records.HEADER_SIZE + spec_length]))
    assert spec[0] == "a" and tuple(spec[2]) == (4, 16)
    wider = pickle.dumps(("a", spec[1], (5, 16), spec[3]), protocol=5)
    assert len(wider) == spec_length  # the same bytes but one: a row more, read from the next record
    grown = bytearray(buf)
    grown[records.HEADER_SIZE : records.HEADER_SIZE + spec_length] = wider
    assert records.read_record(bytes(grown), 0, 1, record.length) is None
