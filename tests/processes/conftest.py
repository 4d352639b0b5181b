"""Fixtures of the process tests."""

from __future__ import annotations

import pytest
from _kit import Kit, record_init

from kerasfeed import ProcessExecutor


@pytest.fixture(scope="module")
def kit():
    """A 2-worker ``ProcessExecutor`` over ``Kit``, shared by a module's tests that do not break it."""
    ex = ProcessExecutor(Kit(), workers=2, seed=1000, worker_init=record_init)
    yield ex
    ex.close()
