"""``RemoteOptions``: how the HDF5 readers talk to an object store (timeouts, retries, request sizes)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Union

from kerasfeed import _validation as _v


@dataclasses.dataclass(frozen=True)
class RemoteOptions:
    """Requests to ``s3://``, ``gs://`` and ``http(s)://`` files (``remote_options=`` of the HDF5 readers).

    Each request (a byte range, or the object's size and ETag) gets up to
    ``attempts`` tries. A try that times out, is throttled (HTTP 429, 503,
    S3's SlowDown), meets a server error (5xx) or a dropped connection is
    tried again after a wait that starts at ``backoff`` seconds and doubles
    up to ``max_backoff`` (each wait drawn between half and all of it, so
    that concurrent readers spread out). With the defaults a request gives
    up after 6 tries and at most 3.1 s of waiting besides the tries
    themselves (each at most ``timeout``); the batch's error then names the
    URL, the range and the causes, and ``retries=`` of ``to_dataset``/
    ``to_loader`` can make the whole batch again on top. A missing object,
    refused credentials and an object replaced during the run
    (``FileChangedError``) are never retried.

    Args:
        timeout: seconds one try of a request may take.
        attempts: tries per request (1: no retry).
        backoff: the first wait between tries, in seconds.
        max_backoff: the longest wait between tries.
        merge_gap: byte ranges of one batch at most this far apart are read
            in one request (the bytes between are read and dropped); ranges
            farther apart are too while the bytes skipped stay within 1/16
            of the bytes needed.
        max_request: a merged request grows no larger than this many bytes,
            and a larger single range (a big chunk, a long run of a
            contiguous dataset) is split into requests of at most this size,
            sent concurrently, each with its own ``timeout``.
        small_dataset: a dataset that stores at most this many bytes (labels,
            say) is fetched whole the first time a process reads it, and
            kept: its rows then cost no request (0: never). A process keeps
            at most 64 MiB so, over all its readers and files
            (``files.KEPT_BUDGET``); past that, datasets are fetched per batch.
        block_size: the size of the blocks that the reads h5py makes itself
            (the file's metadata, datasets outside the fast path) fetch and
            keep.
    """

    timeout: float = 30.0
    attempts: int = 6
    backoff: float = 0.1
    max_backoff: float = 2.0
    merge_gap: int = 4096
    max_request: int = 8 << 20
    small_dataset: int = 1 << 20
    block_size: int = 64 << 10

    def __post_init__(self):
        owner = "RemoteOptions"
        object.__setattr__(self, "timeout", _v.seconds("timeout", self.timeout, allow_none=False, owner=owner))
        object.__setattr__(self, "attempts", _v.positive_int("attempts", self.attempts, owner=owner))
        object.__setattr__(self, "backoff", _v.seconds("backoff", self.backoff, allow_none=False, owner=owner))
        object.__setattr__(self, "max_backoff", _v.seconds("max_backoff", self.max_backoff, allow_none=False,
                                                           owner=owner))
        object.__setattr__(self, "merge_gap", _v.non_negative_int("merge_gap", self.merge_gap, owner=owner))
        object.__setattr__(self, "max_request", _v.positive_int("max_request", self.max_request, owner=owner))
        object.__setattr__(self, "small_dataset", _v.non_negative_int("small_dataset", self.small_dataset,
                                                                       owner=owner))
        object.__setattr__(self, "block_size", _v.positive_int("block_size", self.block_size, owner=owner))

    def wait(self, attempt: int, draw: float) -> float:
        """Seconds to wait after failed try ``attempt`` (0-based); ``draw`` is uniform in [0, 1)."""
        ceiling = min(self.max_backoff, self.backoff * (2**attempt))
        return ceiling * (0.5 + 0.5 * draw)

    @classmethod
    def build(cls, value: Union[None, "RemoteOptions", Mapping[str, Any]], owner: str) -> "RemoteOptions":
        """``remote_options=`` as given (None, a dict of these fields, or an instance), checked once.

        Raises:
            TypeError: not one of those, or an unknown field (named).
            ValueError: a bad value.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(
                f"{owner}: `remote_options` must be a dict, a kerasfeed.hdf5.RemoteOptions or None. "
                f"Received: remote_options={value!r}"
            )
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in value if k not in names]
        if unknown:
            raise TypeError(
                f"{owner}: unknown `remote_options` field {unknown[0]!r} (known: {', '.join(names)}). "
                f"Received: remote_options={dict(value)!r}"
            )
        try:
            return cls(**value)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{owner}: {e}") from e


def check_storage_options(value: Optional[Mapping], owner: str) -> Optional[dict]:
    """``storage_options=`` as given: None or a dict with string keys; returned as a dict (not printed)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        kind = type(value).__name__
        raise TypeError(
            f"{owner}: `storage_options` must be a dict of fsspec options (str keys) or None. Received: a {kind}"
        )
    return dict(value)


__all__ = ["RemoteOptions", "check_storage_options"]
