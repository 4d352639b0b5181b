"""``kerasfeed.orbax``: where a loader stands, in the same Orbax checkpoint as the model (custom loops).

The position is the JSON state ``to_loader(..., initial_state=...)`` takes
(``ResumeState``); ``DataSave``/``DataRestore`` make it an item of the same
Orbax step as the model's state (the pattern: ``docs/orbax.md``).

NOTE [ A plain JSON item ]: the item is Orbax's own JSON item
(``ocp.args.JsonSave``/``JsonRestore``), not a handler of kerasfeed's as Grain
registers for its iterators: any Orbax reader (``ocp.args.JsonRestore()``, the
v1 ``ocp.v1.load_checkpointables``) reads it without importing kerasfeed, the
primary process alone writes it (every process holds the same state: the
fingerprint leaves the shard out), and ``to_loader``/``to_dataset`` check it
where it is used (another order or batch size is refused). Orbax is imported
only by ``DataSave``/``DataRestore``.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping, Optional

from kerasfeed import _validation as _v
from kerasfeed.observe.lookup import PIPELINE_ATTR, find_tagged
from kerasfeed.sampling.protocol import order_fingerprint
from kerasfeed.sampling.state import ResumeState


def position(data: Any, epoch: int, batches: int) -> dict:
    """The state to resume ``data`` after ``batches`` batches of its pass ``epoch`` were consumed.

    Args:
        data: the ``kerasfeed.to_loader`` loader (or ``to_dataset``
            dataset) being read.
        epoch: the pass being read (the ``e`` of ``initial_state``; a loader
            made without one reads pass 0 first, then 1, ...).
        batches: batches of that pass the loop has consumed, counting those
            a resumed loader skipped (``initial_state["batches"]``).

    Returns:
        ``{"epoch", "batches", "order", "items"}``: what ``initial_state=``
        takes. A whole pass consumed is the next pass's start
        (``{"epoch": epoch + 1, "batches": 0, ...}``).

    Raises:
        TypeError: ``data`` is not a kerasfeed dataset or loader.
        ValueError: a negative ``epoch``/``batches``, or more batches than a
            pass holds.
    """
    pipeline = find_tagged(data, PIPELINE_ATTR)
    if pipeline is None or not hasattr(pipeline, "items_per_batch"):
        raise TypeError(
            "kerasfeed.orbax: `data` must be the kerasfeed.to_loader loader (or to_dataset dataset) being read: "
            f"its order and batches make the position. Received: data={data!r} of type {type(data).__name__}"
        )
    epoch = _v.non_negative_int("epoch", epoch, owner="kerasfeed.orbax.position")
    batches = _v.non_negative_int("batches", batches, owner="kerasfeed.orbax.position")
    per_pass = pipeline.batches_per_pass
    if per_pass is not None and batches > per_pass:
        raise ValueError(
            f"kerasfeed.orbax.position: a pass of this data has {per_pass} batches; `batches` counts those of pass "
            f"{epoch} consumed so far (a resumed loader's skipped ones included). Received: batches={batches}"
        )
    if per_pass is not None and batches == per_pass:
        epoch, batches = epoch + 1, 0  # the pass is over: the next one starts (the front ends refuse its end)
    state = ResumeState(epoch, batches, order_fingerprint(pipeline._order), batches * pipeline.items_per_batch)
    return state.to_dict()


def DataSave(data: Any, epoch: Optional[int] = None, batches: Optional[int] = None) -> Any:
    """The Orbax save argument of a data position: one item of ``ocp.args.Composite``.

    Args:
        data: the loader (or dataset) being read, with ``epoch`` and
            ``batches`` (see ``position``); or a state already made: a dict
            from ``position`` or ``kerasfeed.TrainingProgress.state()``, or a
            ``kerasfeed.ResumeState`` (then no ``epoch``/``batches``).

    Returns:
        ``ocp.args.JsonSave`` of the state (NOTE [ A plain JSON item ]).

    Raises:
        TypeError, ValueError: as ``position``; a state that is not one;
            ``epoch``/``batches`` missing beside a loader or given beside a state.
        ModuleNotFoundError: orbax-checkpoint is not installed.
    """
    if isinstance(data, (Mapping, ResumeState)):
        if epoch is not None or batches is not None:
            raise ValueError(
                "kerasfeed.orbax.DataSave: given a state, it is saved as it is; `epoch` and `batches` go with a "
                f"loader or dataset. Received: a state {dict(ResumeState.from_dict(data).to_dict())}, "
                f"epoch={epoch!r}, batches={batches!r}"
            )
        state = ResumeState.from_dict(data).to_dict()
    else:
        if epoch is None or batches is None:
            raise ValueError(
                "kerasfeed.orbax.DataSave(loader, epoch, batches): the position of a loader is the pass it reads "
                "and the batches of it consumed; the loader cannot tell what your loop consumed (it may read "
                f"ahead). Received: epoch={epoch!r}, batches={batches!r}"
            )
        state = position(data, epoch, batches)
    return _ocp().args.JsonSave(state)


def DataRestore() -> Any:
    """The Orbax restore argument of a data position: the item comes back as the saved state (a
    dict), which ``to_loader(..., initial_state=...)`` takes and checks.

    Raises:
        ModuleNotFoundError: orbax-checkpoint is not installed.
    """
    return _ocp().args.JsonRestore()


def _ocp() -> Any:
    try:
        return importlib.import_module("orbax.checkpoint")
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "kerasfeed.orbax needs orbax-checkpoint: pip install 'kerasfeed[orbax]' (or orbax-checkpoint). "
            f"Received: {e}",
            name="orbax",
        ) from e


__all__ = ["DataRestore", "DataSave", "position"]
