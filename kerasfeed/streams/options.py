"""What a pass over shards is told (``InterleaveOptions``) and what ``take`` answers besides items."""

from __future__ import annotations

import dataclasses

from kerasfeed import _validation as _v
from kerasfeed.errors import StreamError


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


NOT_READY = _Marker("NOT_READY")  # take(): nothing arrived within the timeout
END = _Marker("END")  # take(): the pass is over


class NothingRaised(StreamError):
    """A ``StreamError`` that no exception caused: no traceback to show."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.__cause__ = None

    def __reduce__(self):
        return (type(self), StreamError.__reduce__(self)[1])


@dataclasses.dataclass(frozen=True)
class InterleaveOptions:
    """How a pass runs its shards and orders their items.

    Args:
        cycle_length: shards interleaved at a time (deterministic order).
        block_length: consecutive items taken from a shard before moving on.
        deterministic: interleave order (True) or arrival order (False).
        max_open: shards running (or holding buffered items) at once; at
            least ``cycle_length`` so that every shard of the cycle can run.
        buffer_size: items a shard may buffer ahead of the consumer.
        ordered_start: open shards strictly one after the other, in pass
            order. Needed when opening waits for a limited resource (a free
            worker process): shards further ahead must not take the workers
            that the shards the consumer waits for need.
    """

    cycle_length: int
    block_length: int = 1
    deterministic: bool = True
    max_open: int = 1
    buffer_size: int = 8
    ordered_start: bool = False

    def __post_init__(self):
        for name in ("cycle_length", "block_length", "max_open", "buffer_size"):
            object.__setattr__(self, name, _v.positive_int(name, getattr(self, name)))
        for name in ("deterministic", "ordered_start"):
            object.__setattr__(self, name, _v.flag(name, getattr(self, name)))
        if self.max_open < self.cycle_length:
            raise ValueError(
                f"`cycle_length={self.cycle_length}` is larger than the number of shards that can run at "
                f"once ({self.max_open}, `workers`): every shard of the cycle needs a worker. "
                f"Received: cycle_length={self.cycle_length}, workers={self.max_open}"
            )
