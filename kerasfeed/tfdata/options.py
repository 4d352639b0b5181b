"""``DatasetOptions``: every argument of ``to_dataset``, checked once, passed whole (TF-free)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

from kerasfeed import _validation as _v
from kerasfeed._validation import AUTOTUNE
from kerasfeed.loading.options import LoadOptions
from kerasfeed.tfdata.tail import TailOptions


@dataclasses.dataclass(frozen=True)
class DatasetOptions(LoadOptions):
    """The arguments of ``to_dataset`` (see there): the shared ones (``LoadOptions``) and the
    tf.data ones. Derived: ``tail``, the ``TailOptions`` of the end of the pipeline (``prefetch``,
    ``device`` and ``ragged`` checked, with the batching)."""

    api: ClassVar[str] = "to_dataset"

    num_parallel_calls: Optional[int] = None
    prefetch: Optional[int] = AUTOTUNE
    device: Optional[str] = None
    output_signature: Any = None
    ragged: bool = False
    group_items: Optional[int] = None
    copy: bool = False
    tail: TailOptions = dataclasses.field(init=False, repr=False, compare=False)

    def _check_own(self) -> None:
        tail = TailOptions(batch_size=self.batch_size, drop_remainder=self.drop_remainder, ragged=self.ragged,
                           padding_values=self.padding_values, prefetch=self.prefetch, device=self.device)
        self._put("tail", tail)
        calls = _v.positive_int("num_parallel_calls", self.num_parallel_calls, allow_none=True, allow_autotune=True)
        self._put("num_parallel_calls", calls)
        self._put("group_items", _v.positive_int("group_items", self.group_items, allow_none=True))
        self._put("copy", _v.flag("copy", self.copy, owner=self.owner))
        self._put("pool", dataclasses.replace(self.pool, copy_items=self.copy))  # as to_loader's


__all__ = ["DatasetOptions"]
