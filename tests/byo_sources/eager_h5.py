"""The HDF5 habit: files opened in ``__init__`` and kept as attributes (also inside a list and a dict)."""

import h5py
import keras
import numpy as np


class EagerH5(keras.utils.Sequence):
    def __init__(self, path, mode="r", batch=4, **kwargs):
        super().__init__(**kwargs)
        self.f = h5py.File(path, mode)
        self.parts = [self.f["x"], {"labels": self.f["y"]}]
        self.group = self.f["meta"]
        self.batch = batch

    def __len__(self):
        return len(self.f["x"]) // self.batch

    def __getitem__(self, i):
        rows = slice(i * self.batch, (i + 1) * self.batch)
        x, labels = self.parts[0], self.parts[1]["labels"]
        scale = self.group.attrs["scale"]
        return np.asarray(x[rows]) * scale, labels[rows], np.int64(self.f["x"].shape[0])


class RotatingH5(EagerH5):
    """Reads another file each pass: ``on_epoch_end`` opens the next one and keeps its handles."""

    def __init__(self, paths, **kwargs):
        super().__init__(paths[0], **kwargs)
        self.paths, self.k = list(paths), 0

    def on_epoch_end(self):
        self.k += 1
        self.f = h5py.File(self.paths[self.k % len(self.paths)], "r")
        self.parts = [self.f["x"], {"labels": self.f["y"]}]
        self.group = self.f["meta"]
