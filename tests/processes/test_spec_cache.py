"""Item specs read back by the consumer: array-only specs are unpickled once per shape, others every time.

Starts no process: specs are made and read with the transport's own functions.
"""

from __future__ import annotations

import collections
import os

import numpy as np

from kerasfeed.execution.processes import shm

Pair = collections.namedtuple("Pair", "a b")


def _spec_bytes(item) -> bytes:
    spec, _, _ = shm.encode(item)
    return shm.dumps_spec(spec)


def test_array_only_specs_are_shared_and_rebuild_fresh_items():
    shm._SPEC_CACHE.clear()
    item = ({"x": np.arange(12, dtype=np.float32).reshape(4, 3)}, [np.arange(5)], Pair(np.ones(2), np.zeros((1, 1), np.uint8)))
    spec, arrays, nbytes = shm.encode(item)
    raw = shm.dumps_spec(spec)
    first = shm.loads_spec(raw)
    again = shm.loads_spec(bytes(bytearray(raw)))  # equal bytes, another object: as read from the socket
    assert again is first and len(shm._SPEC_CACHE) == 1
    seg, send_fd = shm.new_segment(shm.grown_size(nbytes))
    try:
        shm.write(seg, arrays)
        one, two = shm.decode(first, seg), shm.decode(first, seg)
        # One spec, two items: separate containers and arrays, the values written.
        assert one[0] is not two[0] and one[0]["x"] is not two[0]["x"] and isinstance(one[2], Pair)
        np.testing.assert_array_equal(one[0]["x"], item[0]["x"])
        np.testing.assert_array_equal(two[1][0], item[1][0])
        one[0]["x"][0, 0] = -1
        assert two[0]["x"][0, 0] == 0
    finally:
        os.close(send_fd)
        seg.close()


def test_specs_with_inline_objects_are_read_every_time():
    shm._SPEC_CACHE.clear()
    raw = _spec_bytes((np.zeros(3), {"meta": ["a", "list"]}, 7))
    first, second = shm.loads_spec(raw), shm.loads_spec(raw)
    assert first == second and first is not second  # a mutable object must not be shared between items
    assert shm._SPEC_CACHE == {}


def test_cache_stays_bounded_when_shapes_keep_changing():
    shm._SPEC_CACHE.clear()
    for n in range(1, 3 * shm._SPEC_CACHE_MAX):
        spec = shm.loads_spec(_spec_bytes(np.zeros(n, np.float32)))
        assert spec[0] == "a" and spec[2] == (n,)
        assert len(shm._SPEC_CACHE) <= shm._SPEC_CACHE_MAX
