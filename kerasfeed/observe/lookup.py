"""Finding the kerasfeed pipeline behind a ``tf.data.Dataset`` (derived or not) or a loader (TF-free).

``to_dataset``, ``to_loader`` and the stream functions tag what they return with
the object that owns their pipeline (and its executor). A dataset derived with
``.map``/``.batch``/``.take``... has no tag, so the lookup walks tf.data's own
input links (``_inputs()``) back to a tagged one.
"""

from __future__ import annotations

from typing import Any, Optional

# Attributes a kerasfeed front end sets on the dataset it returns.
PIPELINE_ATTR = "_kerasfeed_pipeline"
EXECUTOR_ATTR = "_kerasfeed_executor"


def find_tagged(ds: Any, attr: str) -> Optional[Any]:
    """Returns ``getattr(d, attr)`` for the nearest ``d`` among ``ds`` and the
    datasets it was derived from, or None."""
    found = _tagged(ds, attr, every=False)
    return found[0] if found else None


def find_all_tagged(ds: Any, attr: str) -> list:
    """``getattr(d, attr)`` of every tagged ``d`` among ``ds`` and the datasets it was derived from, nearest
    first: the pipelines of a ``tf.data.Dataset.zip`` of several kerasfeed datasets. A tagged dataset's own
    inputs are not looked into."""
    return _tagged(ds, attr, every=True)


def _tagged(ds: Any, attr: str, every: bool) -> list:
    seen: set[int] = set()
    found: list = []
    todo = [ds]
    while todo:
        d = todo.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        value = getattr(d, attr, None)
        if value is not None:
            if all(value is not f for f in found):
                found.append(value)
            if not every:
                break
            continue
        inputs = getattr(d, "_inputs", None)
        if callable(inputs):
            try:
                todo.extend(inputs())
            except Exception:  # noqa: BLE001 - a dataset kind without inputs
                pass
    return found


def executor_of(ds: Any):
    """Returns the executor that makes the items of a kerasfeed dataset.

    Works on the dataset ``to_dataset`` returned and on datasets derived from
    it (``ds.map(...).batch(...)``). Its ``name`` is ``"threads"`` or
    ``"processes"``; with ``executor="auto"`` its ``reason`` says why it was
    chosen.

    Args:
        ds: a ``tf.data.Dataset`` from ``kerasfeed.to_dataset`` or derived from one.

    Returns:
        The ``kerasfeed`` executor (``ThreadExecutor`` or ``ProcessExecutor``).

    Raises:
        ValueError: ``ds`` was not made by ``kerasfeed.to_dataset``.

    Example:

    ```python
    ds = kerasfeed.to_dataset(seq, executor="auto").map(lambda x, y: (x * 2, y))
    ex = kerasfeed.executor_of(ds)
    print(ex.name, ex.reason)
    ```
    """
    ex = find_tagged(ds, EXECUTOR_ATTR)
    if ex is None:
        raise ValueError(
            "executor_of() needs a dataset made by kerasfeed.to_dataset (or derived from one with "
            f".map/.batch/...) or a kerasfeed.to_loader loader. Received: {type(ds).__name__}"
        )
    return ex


__all__ = ["executor_of", "find_all_tagged", "find_tagged"]
