"""``loading/begins.py`` alone: each begin of a pass is a ticket (NOTE [ A pass begun again ])."""

from __future__ import annotations

import threading
import time

import pytest

from kerasfeed.loading.begins import TICKET_BITS, Begins, pass_of


def test_a_pass_begun_again_gets_a_new_ticket_of_the_same_pass():
    begins = Begins(kept=8)
    first = begins.issue(3, range(5))
    again = begins.issue(3, range(5))
    assert first == 3 and again == 3 + (1 << TICKET_BITS)
    assert pass_of(first) == pass_of(again) == 3
    assert pass_of(begins.issue(3, range(5))) == 3


def test_the_older_begin_is_refused_and_leaves_the_newer_count_alone():
    begins = Begins(kept=8)
    old = begins.issue(0, range(2))
    begins.enter(old)
    assert begins.leave(old, loaded=True) is False  # 1 of 2 loaded
    new = begins.issue(0, range(2))
    with pytest.raises(RuntimeError, match="pass 0 began again for a newer iterator"):
        begins.enter(old)
    with pytest.raises(RuntimeError, match="pass 0 began again"):
        begins.view(old)
    assert begins.read_whole(old) is False
    begins.enter(new)
    assert begins.leave(new, loaded=True) is False
    begins.enter(new)
    assert begins.leave(new, loaded=True) is True  # the newer begin's own two items, counted whole


def test_a_begin_again_waits_for_the_older_begins_takes_under_way():
    begins = Begins(kept=8)
    old = begins.issue(0, range(4))
    begins.enter(old)  # a take of the older begin, under way
    issued = []
    thread = threading.Thread(target=lambda: issued.append(begins.issue(0, range(4))))
    thread.start()
    time.sleep(0.3)
    assert issued == []  # waits: that take reads the older begin's plan
    assert begins.leave(old, loaded=True) is False  # its pass began again: not its last item
    thread.join(5)
    assert issued == [1 << TICKET_BITS]


def test_passes_older_than_kept_are_forgotten():
    begins = Begins(kept=2)
    tickets = [begins.issue(e, range(3)) for e in range(4)]
    assert begins.progress(tickets[0]) == (None, 0)
    assert begins.progress(tickets[3])[1] == 3
