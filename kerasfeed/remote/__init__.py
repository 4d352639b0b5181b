"""HDF5 files in object stores: ``s3://``, ``gs://`` and ``http(s)://`` URLs for the HDF5 readers (docs/remote.md).

fsspec and the store's filesystem (s3fs, gcsfs, aiohttp for HTTP) are
imported only when a URL is read (``pip install kerasfeed[remote]``); this
package imports nothing itself, so a reader of local files loads only
``urls.py`` and ``options.py``.

Modules: ``urls.py`` (which paths are URLs, ``storage_options`` split into
what travels and what stays: NOTE there), ``options.py``
(``RemoteOptions``: timeouts, retries, request sizes), ``fetch.py`` (byte
ranges pinned to the object's version, with retries: NOTE there),
``chunks.py`` (the fast path: chunk layouts and decoding, which layouts
and filters take it: NOTE there), ``hdf5lib.py`` (HDF5 calls h5py does
not wrap, through ctypes), ``h5file.py`` (the file object h5py reads
through, and the collector held off meanwhile: NOTE there), ``files.py``
(``RemoteFile``, ``read_parts``: one wave of requests per batch).
"""
