"""A remote HDF5 reader where TensorFlow cannot be imported (run by ``test_remote_without_tensorflow.py``).

Reads ``argv[1]`` (an ``http://`` URL of a scene file on a loopback store) with ``H5SliceSequence``
through ``to_loader`` on two worker processes, opening and closing the loader ``argv[2]`` times (each
close ends its workers: the exit path that once aborted with "terminate called without an active
exception"), then trains one JAX epoch on it with ``model.fit``. Prints one JSON line: the digest of
every pass's batches, the fit's loss and whether TensorFlow was imported.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

import kerasfeed


def digest(batches) -> str:
    h = hashlib.sha256()
    for points, labels in batches:
        for leaf in (points, labels):
            a = np.asarray(leaf)
            h.update(f"{a.dtype}{a.shape}".encode())
            h.update(a.tobytes())
    return h.hexdigest()


def main(url: str, rounds: int) -> None:
    seq = kerasfeed.H5SliceSequence(url, ("points", "labels"), 4)
    passes = []
    for _ in range(rounds):
        loader = kerasfeed.to_loader(seq, executor="processes", workers=2)
        try:
            passes.append(digest(loader))
        finally:
            loader.close()

    import keras

    model = keras.Sequential([keras.layers.Input((None, 6)), keras.layers.GlobalAveragePooling1D(),
                              keras.layers.Dense(4)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    train = kerasfeed.H5SliceSequence(url, ("points", "labels"), 4, shuffle=True, seed=0,
                                      transform=lambda batch, rng: (batch[0], batch[1] % 4))
    loader = kerasfeed.to_loader(train, executor="processes", workers=2)
    try:
        history = model.fit(loader, epochs=1, verbose=0)
    finally:
        loader.close()
    print(json.dumps({"backend": keras.backend.backend(), "passes": passes, "loss": history.history["loss"],
                      "tensorflow_imported": "tensorflow" in sys.modules}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
