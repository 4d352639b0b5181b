"""The URL schemes kerasfeed reads remotely, for every layer that meets a path (the HDF5 readers,
``BalancedOrder.from_hdf5``): one table, so a scheme one accepts the other accepts too."""

from __future__ import annotations

# URL scheme -> fsspec protocol of the filesystems that read it.
PROTOCOLS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "https"}


def is_url(path: object) -> bool:
    """Whether ``path`` names an object in a store kerasfeed reads remotely (s3, gs, http(s))."""
    if not isinstance(path, str):
        return False
    head, sep, _ = path.partition("://")
    return bool(sep) and head.lower() in PROTOCOLS


def protocol(url: str) -> str:
    """fsspec's protocol for ``url`` (``s3``, ``gcs``, ``http``, ``https``)."""
    return PROTOCOLS[url.partition("://")[0].lower()]


def keyed_by_scheme(options: dict) -> bool:
    """Whether ``storage_options`` is fsspec's per-filesystem form (``{"s3": {...}, "https": {...}}``)."""
    return bool(options) and all(isinstance(k, str) and k.lower() in PROTOCOLS for k in options)


__all__ = ["PROTOCOLS", "is_url", "keyed_by_scheme", "protocol"]
