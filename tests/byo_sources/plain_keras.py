"""``import keras`` and ``keras.utils.Sequence``: the most common style."""

import keras

from byo_sources._flags import framework_flags, item


class KerasSequence(keras.utils.Sequence):
    def __init__(self, n=6, **kwargs):
        super().__init__(**kwargs)
        self.n = n
        self.offset = 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x, y = item(i, self.offset)
        return {"x": x, "y": y, "flags": framework_flags()}

    def on_epoch_end(self):
        self.offset += 100  # reaches the workers before the next pass (state_sync)


class ToCategorical(KerasSequence):
    """Uses Keras inside ``__getitem__``: the worker loads it then, and only then."""

    def __getitem__(self, i):
        x, y = item(i, self.offset)
        return {"x": x, "y": keras.utils.to_categorical(y, 3), "flags": framework_flags()}
