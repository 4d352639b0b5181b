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
    """The arguments of ``to_dataset`` (see there): the shared ones
    (``LoadOptions``) and the tf.data ones.

    Attributes:
        num_parallel_calls: None (the executor makes items ahead, the map is
            sequential), an int or ``AUTOTUNE`` (a parallel map).
        prefetch, device, ragged: the tail's (``tail`` holds them checked,
            with the batching).
        output_signature: a nest of ``tf.TensorSpec``, or None to probe.
        group_items: items per Python call (None: decided from the probes).

    Derived:
        tail: the ``TailOptions`` of the end of the pipeline.
    """

    api: ClassVar[str] = "to_dataset"

    num_parallel_calls: Optional[int] = None
    prefetch: Optional[int] = AUTOTUNE
    device: Optional[str] = None
    output_signature: Any = None
    ragged: bool = False
    group_items: Optional[int] = None
    tail: TailOptions = dataclasses.field(init=False, repr=False, compare=False)

    def _check_own(self) -> None:
        self._put(
            "tail",
            TailOptions(
                batch_size=self.batch_size,
                drop_remainder=self.drop_remainder,
                ragged=self.ragged,
                padding_values=self.padding_values,
                prefetch=self.prefetch,
                device=self.device,
            ),
        )
        self._put(
            "num_parallel_calls",
            _v.positive_int("num_parallel_calls", self.num_parallel_calls, allow_none=True, allow_autotune=True),
        )
        self._put("group_items", _v.positive_int("group_items", self.group_items, allow_none=True))


__all__ = ["DatasetOptions"]
