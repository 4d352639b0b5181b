"""A module that uses TensorFlow when it is imported: its workers must load TensorFlow, and say why."""

import numpy as np
import tensorflow as tf

SCALE = float(tf.constant(2.0))  # module level: runs in every process that imports this module


class Scaled(tf.keras.utils.Sequence):
    def __len__(self):
        return 3

    def __getitem__(self, i):
        return np.full((2, 2), i * SCALE, np.float32)
