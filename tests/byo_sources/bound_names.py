"""Framework names bound when the module is imported and used in ``__getitem__``: a worker keeps them
as forwarding names (``LazyName``: nothing loads at import) that the framework takes as the real ones."""

import numpy as np
import tensorflow as tf
from tensorflow import float32
from tensorflow.keras.utils import to_categorical

DTYPE = tf.float32  # read at import: in a worker, a name that waits for its first use


class Bound(tf.keras.utils.Sequence):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        a = tf.cast(tf.constant([i, i + 1]), DTYPE)
        b = tf.constant([i], float32)
        y = to_categorical(np.array([i]), num_classes=3)
        lazy = [type(g).__name__ == "LazyName" for g in (DTYPE, float32, to_categorical)]
        return np.asarray(a), np.asarray(b), y, np.array([a.dtype == float32, DTYPE == tf.float32]), np.array(lazy)
