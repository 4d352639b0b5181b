"""``MixedSequence``: a mix of ``SceneSequence``s that is itself one, for ``model.fit``."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from kerasfeed.sampling.mixcore import MixCore
from kerasfeed.sources.sequence import SceneSequence


class MixedSequence(MixCore, SceneSequence):
    """Several ``PyDataset``/``SceneSequence`` parts as one ``SceneSequence`` (see ``kerasfeed.mix``).

    ``model.fit(mixed)`` and ``to_dataset(mixed)`` both work. Epoch hooks reach every part: ``set_epoch``
    (in every process that reads), ``on_epoch_begin`` and ``on_epoch_end`` (so each part's ``epoch``
    advances as it would on its own). Keras' ``workers``, ``use_multiprocessing`` and ``max_queue_size``
    are taken from the first part that is a ``PyDataset``.
    """

    def __init__(self, sources: Sequence[Any], weights: Any = None, *, seed: Optional[int] = None, check: bool = True):
        parts = list(sources)
        keras_part = next((p for p in parts if hasattr(p, "max_queue_size")), None)
        SceneSequence.__init__(
            self,
            workers=getattr(keras_part, "workers", 1),
            use_multiprocessing=getattr(keras_part, "use_multiprocessing", False),
            max_queue_size=getattr(keras_part, "max_queue_size", 10),
        )
        self._init_mix(parts, weights, seed, check)


__all__ = ["MixedSequence"]
