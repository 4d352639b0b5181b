"""The slot table and the lending budget, without any worker process.

Segments are real shared memory (``shm.new_segment``), mapped as the reader
thread maps the ones a worker sends.
"""

from __future__ import annotations

import gc
import os

import numpy as np

from kerasfeed.execution.processes import shm
from kerasfeed.execution.processes.slots import LEND_MIN_BYTES, MAX_LENT_BYTES, MAX_LENT_PER_WORKER, SlotTable


def _send_segment(table: SlotTable, worker: int, slot: int, size: int) -> shm.Segment:
    """What a worker does for a new slot: create a segment and send its fd."""
    seg, fd = shm.new_segment(size, "test")
    table.map_segment(worker, slot, [fd], size)
    return seg


def test_take_prefers_the_lowest_free_slot_and_grows_only_when_none_is_free():
    table = SlotTable(workers=2, initial=2)
    assert table.free_slots(0) == [0, 1] and table.allocated(0) == 2 and table.in_use() == 0
    assert [table.take(0), table.take(0)] == [0, 1]
    assert table.take(0) == 2  # every slot taken: a new one
    assert table.allocated(0) == 3 and table.in_use() == 3
    table.give_back(0, 1)
    table.give_back(0, 0)
    assert table.take(0) == 0  # the lowest: its segment most likely exists
    assert table.free_slots(0) == [1] and table.free_slots(1) == [0, 1]
    table.give_back_all(0, [0, 2])
    assert table.in_use() == 0


def test_mapped_segments_are_replaced_when_grown_and_counted():
    table = SlotTable(workers=1, initial=1)
    writer = _send_segment(table, 0, 0, 4096)
    assert table.shm_bytes() == 4096
    shm.write(writer, shm.encode(np.arange(10, dtype=np.int64))[1])
    assert bytes(table.segment(0, 0).mm[:8]) == np.int64(0).tobytes()
    table.map_segment(0, 0, [], None)  # no new segment: the old one stays
    assert table.shm_bytes() == 4096
    writer2 = _send_segment(table, 0, 0, 8192)  # grown: the old mapping is closed
    assert table.shm_bytes() == 8192 and table.segment(0, 0).size == 8192
    assert table.segment(0, 1) is None
    table.close_segments(0)
    assert table.shm_bytes() == 0
    writer.close()
    writer2.close()


def test_every_fd_sent_with_a_segment_is_closed():
    def open_fds():
        return len(os.listdir("/proc/self/fd"))

    table = SlotTable(workers=1, initial=1)
    before = open_fds()
    seg, fd = shm.new_segment(4096, "test")
    r, w = os.pipe()
    table.map_segment(0, 0, [fd, r], 4096)  # an unexpected extra fd is closed too
    os.close(w)
    seg.close()
    table.close_segments(0)
    gc.collect()
    assert open_fds() == before


def test_lending_budget_small_items_per_worker_and_total_bytes():
    table = SlotTable(workers=2, initial=2)
    assert not table.try_lend(0, LEND_MIN_BYTES - 1, LEND_MIN_BYTES)  # small: copied
    for _ in range(MAX_LENT_PER_WORKER):
        assert table.try_lend(0, LEND_MIN_BYTES, LEND_MIN_BYTES)
    assert not table.try_lend(0, LEND_MIN_BYTES, LEND_MIN_BYTES)  # this worker's budget is spent
    assert table.try_lend(1, LEND_MIN_BYTES, LEND_MIN_BYTES)  # not the other's
    assert not table.try_lend(1, MAX_LENT_BYTES, MAX_LENT_BYTES)  # over the total
    assert table.lent_items == MAX_LENT_PER_WORKER + 1
    assert table.lent_bytes == (MAX_LENT_PER_WORKER + 1) * LEND_MIN_BYTES


def test_the_lending_budget_counts_the_segment_a_loan_pins_not_the_item():
    """A 13 MB item lent from a 51 MB segment an earlier 45 MB item grew keeps all 51 MB mapped: the budget
    counted 13 (helper: 208 MB booked, 538-718 MB pinned against MAX_LENT_BYTES = 256 MB)."""
    table = SlotTable(workers=1, initial=1)
    item, segment = 13 * 2**20, 51 * 2**20
    lent = 0
    while table.try_lend(0, item, segment):
        lent += 1
    assert lent == MAX_LENT_BYTES // segment and table.lent_bytes == lent * segment <= MAX_LENT_BYTES


def test_a_returned_loan_frees_its_slot_only_when_collected():
    table = SlotTable(workers=1, initial=2)
    slot = table.take(0)
    writer = _send_segment(table, 0, slot, shm.grown_size(LEND_MIN_BYTES))
    spec, arrays, nbytes = shm.encode(np.ones(LEND_MIN_BYTES // 4, np.float32))
    shm.write(writer, arrays)
    pinned = table.segment(0, slot).size
    assert table.try_lend(0, nbytes, pinned)
    item = shm.lend(spec, table.segment(0, slot), nbytes, table.loan_returned(0, slot, pinned))
    assert float(item.sum()) == LEND_MIN_BYTES // 4
    table.collect_returned()
    assert slot not in table.free_slots(0) and table.lent_bytes == pinned  # still lent
    del item
    gc.collect()
    assert slot not in table.free_slots(0)  # returned, not collected yet (no lock in a finalizer)
    table.collect_returned()
    assert slot in table.free_slots(0) and table.lent_bytes == 0 and table.in_use() == 0
    assert table.try_lend(0, nbytes, pinned)  # the budget is back
    table.close_segments(0)
    writer.close()
