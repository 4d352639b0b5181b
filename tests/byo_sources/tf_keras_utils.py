"""``from tensorflow.keras.utils import Sequence`` (and ``from tensorflow import keras``)."""

from tensorflow import keras
from tensorflow.keras.utils import Sequence

from byo_sources._flags import framework_flags, item


class TfSequence(Sequence):
    def __init__(self, n=5, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x, y = item(i, 3)
        return x, y, framework_flags()


class TfKerasSequence(keras.utils.Sequence):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        x, y = item(i, 11)
        return x, y, framework_flags()
