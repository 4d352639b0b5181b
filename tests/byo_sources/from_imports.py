"""Names imported from the framework at the top: ``from tensorflow.keras.utils import Sequence, to_categorical``."""

from tensorflow.keras.utils import Sequence, to_categorical

from byo_sources._flags import framework_flags, item


class OneHot(Sequence):
    """``to_categorical`` is imported at the top but called only when ``encode``."""

    def __init__(self, encode=False, **kwargs):
        super().__init__(**kwargs)
        self.encode = encode

    def __len__(self):
        return 4

    def __getitem__(self, i):
        x, y = item(i, 0)
        if self.encode:
            y = to_categorical(y, 3)
        return x, y, framework_flags()
