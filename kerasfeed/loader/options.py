"""``LoaderOptions``: every argument of ``to_loader``, checked once, passed whole (TF-free)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

from kerasfeed import _validation as _v
from kerasfeed.loader.device import check_depth
from kerasfeed.loading.options import LoadOptions


@dataclasses.dataclass(frozen=True)
class LoaderOptions(LoadOptions):
    """The arguments of ``to_loader`` (see there): the shared ones (``LoadOptions``) and its
    own: ``ragged`` (must stay False: numpy has no ragged arrays; refused by name), ``copy``
    and ``device_prefetch`` (``device.py``)."""

    api: ClassVar[str] = "to_loader"
    owner: ClassVar[Optional[str]] = "to_loader"
    handover: ClassVar[str] = "numpy"

    ragged: bool = False
    copy: bool = False
    device_prefetch: Optional[int] = None

    def _check_own(self) -> None:
        if self.ragged is not False:
            _v.flag("ragged", self.ragged, owner=self.owner)
            raise ValueError(
                "to_loader batches in numpy, which has no ragged arrays: samples whose shapes vary are padded "
                "(`padding_values=`), or return whole batches from `source[i]` with batch_size=None "
                "(use to_dataset for tf.RaggedTensor batches). Received: ragged=True"
            )
        self._put("copy", _v.flag("copy", self.copy, owner=self.owner))
        self._put("pool", dataclasses.replace(self.pool, copy_items=self.copy))
        self._put("device_prefetch", check_depth(self.device_prefetch))


__all__ = ["LoaderOptions"]
