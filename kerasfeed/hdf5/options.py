"""``H5Options``: the keyword arguments every HDF5 sequence shares, declared once.

The public constructors keep flat keyword arguments (as Keras and PyTorch do), declare only their own
and forward the rest as ``**options``, which ``H5Options.build`` checks (unknown names refused by name,
values checked up front) and freezes into the one object ``H5Base`` reads. ``H5Keywords`` gives the same
names and types to type checkers and IDEs (``**options: Unpack[H5Keywords]``); a test keeps the two in step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, TypedDict

import numpy as np

from kerasfeed import _validation as _v
from kerasfeed.remote.options import RemoteOptions, check_storage_options

Transform = Callable[[Any, np.random.Generator], Any]


@dataclasses.dataclass(frozen=True)
class H5Options:
    """The shared arguments of ``H5SliceSequence``, ``H5WindowSequence`` and ``H5RowSequence``.

    Args:
        shuffle, seed, drop_remainder, transform, swmr, open_kwargs, workers, use_multiprocessing,
            max_queue_size: see ``H5SliceSequence``.
        storage_options: fsspec options for ``s3://``, ``gs://`` and ``http(s)://`` paths (endpoint,
            credentials, ``anon``); secret ones never leave this process (docs/remote.md).
        remote_options: timeouts, retries and request sizes for those paths: a dict of ``RemoteOptions``
            fields, or one.
        max_open_files: the most local files the sequence keeps open in one process; past it the least
            recently read one closes (and reopens when read again, ~1 ms). None: a quarter of the soft
            ``RLIMIT_NOFILE``, at least 16 (NOTE [ How many HDF5 files a sequence keeps open ], ``held.py``).
    """

    shuffle: bool = False
    seed: Optional[int] = None
    drop_remainder: bool = False
    transform: Optional[Transform] = None
    swmr: bool = False
    open_kwargs: Optional[Mapping[str, Any]] = None
    storage_options: Optional[Mapping[str, Any]] = dataclasses.field(default=None, repr=False)
    remote_options: Any = None
    workers: int = 1
    use_multiprocessing: bool = False
    max_queue_size: int = 10
    max_open_files: Optional[int] = None

    @classmethod
    def build(cls, owner: str, keywords: Mapping[str, Any], refused: Optional[Mapping[str, str]] = None) -> "H5Options":
        """Checks the keyword arguments a constructor forwarded; returns them frozen.

        Args:
            owner: the public class, for messages.
            keywords: the forwarded keyword arguments.
            refused: shared names the class does not take, with why.

        Raises:
            TypeError: an unknown or refused keyword (named), a bad type.
            ValueError: a bad value.
        """
        refused = refused or {}
        names = [f.name for f in dataclasses.fields(cls)]
        for name, value in keywords.items():
            if name in refused:
                raise TypeError(f"{owner} does not take `{name}`: {refused[name]}. Received: {name}={value!r}")
            if name not in names:
                accepted = ", ".join(n for n in names if n not in refused)
                raise TypeError(
                    f"{owner} got an unexpected keyword argument `{name}` (besides its own arguments it takes "
                    f"{accepted}). Received: {name}={value!r}"
                )
        kw = dict(keywords)
        for name in ("shuffle", "drop_remainder", "swmr", "use_multiprocessing"):
            if name in kw:
                kw[name] = _v.flag(name, kw[name], owner=owner)
        if "seed" in kw:
            kw["seed"] = _v.seed("seed", kw["seed"], owner=owner)
        if kw.get("max_open_files") is not None:
            kw["max_open_files"] = _v.positive_int("max_open_files", kw["max_open_files"], owner=owner)
        transform = kw.get("transform")
        if transform is not None and not callable(transform):
            raise TypeError(
                f"{owner}: `transform` must be a callable `transform(batch, rng)` or None. "
                f"Received: transform={transform!r}"
            )
        open_kwargs = kw.get("open_kwargs")
        if open_kwargs is not None:
            if not isinstance(open_kwargs, Mapping):
                raise TypeError(f"{owner}: `open_kwargs` must be a dict or None. Received: open_kwargs={open_kwargs!r}")
            for reserved in ("name", "mode", "swmr"):
                if reserved in open_kwargs:
                    raise ValueError(
                        f"{owner}: `open_kwargs` may not set {reserved!r}: files are opened read-only "
                        f"(use `swmr=` for SWMR). Received: open_kwargs={dict(open_kwargs)!r}"
                    )
            kw["open_kwargs"] = dict(open_kwargs)
        if "storage_options" in kw:
            kw["storage_options"] = check_storage_options(kw["storage_options"], owner)
        if kw.get("remote_options") is not None:
            kw["remote_options"] = RemoteOptions.build(kw["remote_options"], owner)
        return cls(**kw)


class H5Keywords(TypedDict, total=False):
    """``H5Options`` as keyword arguments, for type hints of ``**options``."""

    shuffle: bool
    seed: Optional[int]
    drop_remainder: bool
    transform: Optional[Transform]
    swmr: bool
    open_kwargs: Optional[Mapping[str, Any]]
    storage_options: Optional[Mapping[str, Any]]
    remote_options: Any
    workers: int
    use_multiprocessing: bool
    max_queue_size: int
    max_open_files: Optional[int]


__all__ = ["H5Options", "H5Keywords"]
