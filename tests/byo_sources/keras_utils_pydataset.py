"""``from keras.utils import PyDataset``."""

from keras.utils import PyDataset

from byo_sources._flags import framework_flags, item


class Rows(PyDataset):
    def __init__(self, n=5, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x, y = item(i, 7)
        return x, y, framework_flags()
