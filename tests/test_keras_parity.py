"""to_dataset against model.fit(seq): state changed by epoch hooks reaches worker
processes, Keras 3 style sources (num_batches, infinite), short batches mid-pass."""

from __future__ import annotations

import sys
import threading
import time

import cloudpickle
import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasfeed
from kerasfeed.execution.processes.executor import ProcessExecutor

# The sources below reach the workers by value, like code in a notebook: the
# workers do not import this module (nor TensorFlow with it).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

EPOCHS = 3
WORKER_COUNTS = (1, 2, 3)


def _recording_fit(seq, epochs=EPOCHS, **fit_kwargs):
    """Trains a tiny model on ``seq`` and returns the sample ids of every
    batch the train step saw, in order (x[:, 0] carries the ids)."""
    seen: list[list[int]] = []

    class Recording(keras.Sequential):
        def train_step(self, data):
            seen.append([int(v) for v in np.asarray(data[0])[:, 0]])
            return super().train_step(data)

    model = Recording([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", run_eagerly=True)
    history = model.fit(seq, epochs=epochs, verbose=0, **fit_kwargs)
    assert np.all(np.isfinite(history.history["loss"]))
    return seen


def _passes(ds, passes=EPOCHS):
    return [[int(v) for v in x.numpy()[:, 0]] for _ in range(passes) for x, _ in ds]


def _batch(ids):
    ids = np.asarray(ids, np.float32)
    return np.stack([ids, ids * 0 + 1], axis=1), ids[:, None] * 0.01


class Reshuffling(kerasfeed.SceneSequence):
    """Re-shuffles its own index list, in place, with its own generator,
    at the end of every epoch (the Keras documentation's pattern)."""

    def __init__(self, samples=12, batch=2):
        super().__init__()
        self.batch = batch
        self.indices = np.arange(samples)
        self.rng = np.random.default_rng(7)

    def __len__(self):
        return len(self.indices) // self.batch

    def __getitem__(self, i):
        return _batch(self.indices[i * self.batch : (i + 1) * self.batch])

    def on_epoch_end(self):
        self.rng.shuffle(self.indices)


class Curriculum(kerasfeed.SceneSequence):
    """Reads the easy file, then the hard one from epoch 2 on (switched in
    on_epoch_begin); items read the file on every call."""

    def __init__(self, easy, hard, batches=6):
        super().__init__()
        self.files, self.path, self.batches = (easy, hard), easy, batches

    def __len__(self):
        return self.batches

    def __getitem__(self, i):
        data = np.load(self.path, mmap_mode="r")
        return _batch(data[2 * i : 2 * i + 2])

    def on_epoch_begin(self):
        self.path = self.files[1] if self.epoch >= 2 else self.files[0]


def test_reshuffling_source_same_batches_threads_processes_and_fit():
    # model.fit(seq) calls on_epoch_end once before its first epoch (EpochIterator.reset):
    # a source that re-shuffles on every call is one shuffle ahead there, so the
    # to_dataset runs below make that call too (see docs/keras_parity.md).
    reference = _recording_fit(Reshuffling(), shuffle=False)
    orders = [sorted(map(tuple, reference[k * 6 : (k + 1) * 6])) for k in range(EPOCHS)]
    assert len(reference) == 6 * EPOCHS and orders[0] != orders[1] != orders[2]  # the source really changes

    def run(executor):
        seq = Reshuffling()
        seq.on_epoch_end()
        return _passes(kerasfeed.to_dataset(seq, executor=executor(seq) if callable(executor) else executor))

    assert run("threads") == reference
    sources = {n: Reshuffling() for n in WORKER_COUNTS}
    for seq in sources.values():
        seq.on_epoch_end()
    executors = {n: ProcessExecutor(seq, workers=n, seed=0) for n, seq in sources.items()}
    try:
        for n, ex in executors.items():
            assert _passes(kerasfeed.to_dataset(sources[n], executor=ex)) == reference, f"workers={n}"
            assert ex.stats()["state"]["syncs"] == EPOCHS - 1  # one per pass boundary where it changed
    finally:
        for ex in executors.values():
            ex.close()


def test_curriculum_switching_files_same_batches_threads_processes_and_fit(tmp_path):
    easy, hard = tmp_path / "easy.npy", tmp_path / "hard.npy"
    np.save(easy, np.arange(12))
    np.save(hard, np.arange(100, 112))
    reference = _recording_fit(Curriculum(easy, hard), shuffle=False)
    assert [b[0] for b in reference[::6]] == [0, 0, 100]
    assert _passes(kerasfeed.to_dataset(Curriculum(easy, hard))) == reference
    sources = {n: Curriculum(easy, hard) for n in WORKER_COUNTS}
    executors = {n: ProcessExecutor(seq, workers=n, seed=0) for n, seq in sources.items()}
    try:
        for n, ex in executors.items():
            # Workers start pass 2 ahead from the easy file: those items must be dropped.
            assert _passes(kerasfeed.to_dataset(sources[n], executor=ex)) == reference, f"workers={n}"
    finally:
        for ex in executors.values():
            ex.close()


def test_unpicklable_state_changed_in_a_hook_fails_at_the_pass_boundary():
    class Opens(Reshuffling):
        def on_epoch_end(self):
            self.handle = threading.Lock()  # e.g. a file or connection opened here

    seq = Opens()
    ex = ProcessExecutor(seq, workers=1, seed=0)
    try:
        ds = kerasfeed.to_dataset(seq, executor=ex)
        assert len(_passes(ds, 1)) == 6  # the first pass is whole
        with pytest.raises(tf.errors.OpError, match=r"`source\.handle` \(_thread\.lock\) cannot be pickled"):
            _passes(ds, 1)
    finally:
        ex.close()


def test_unchanged_large_array_is_not_resent_and_changed_in_place_is():
    class Holds(kerasfeed.SceneSequence):
        def __init__(self):
            super().__init__()
            self.table = np.arange(2**21, dtype=np.float64)  # 16 MB, writeable
            self.offset = 0

        def __len__(self):
            return 4

        def __getitem__(self, i):
            ids = self.table[[2 * i, 2 * i + 1]] + self.offset
            return _batch(ids)

    seq = Holds()
    ex = ProcessExecutor(seq, workers=1, seed=0)
    try:
        ds = kerasfeed.to_dataset(seq, executor=ex)
        assert _passes(ds, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]] * 2
        assert ex.stats()["state"]["syncs"] == 0  # nothing changed: nothing sent
        seq.table[:8] += 10  # in place, between passes
        assert _passes(ds, 1) == [[10, 11], [12, 13], [14, 15], [16, 17]]
        state = ex.stats()["state"]
        assert state["syncs"] == 1 and state["sent_bytes"] > seq.table.nbytes
        seq.offset = 100  # a small attribute: only it travels
        assert _passes(ds, 1)[0] == [110, 111]
        assert ex.stats()["state"]["sent_bytes"] - state["sent_bytes"] < 10_000
    finally:
        ex.close()


def test_last_item_survives_on_epoch_end_changing_its_arrays_in_place():
    class Views(kerasfeed.SceneSequence):
        def __init__(self):
            super().__init__()
            self.table = np.repeat(np.arange(8, dtype=np.float32), 4096)[:, None] * np.ones(16, np.float32)

        def __len__(self):
            return 8

        def __getitem__(self, i):
            return self.table[i * 4096 : (i + 1) * 4096]  # a view of the source's array

        def on_epoch_end(self):
            self.table[:] = -1  # runs as the last item is handed over

    firsts = [float(b[0, 0]) for b in kerasfeed.to_dataset(Views())]
    assert firsts == [float(i) for i in range(8)]


class Counted(kerasfeed.SceneSequence):
    """Keras 3 style: ``num_batches`` instead of ``__len__``."""

    def __init__(self, batches=None):
        super().__init__()
        self._batches = batches

    @property
    def num_batches(self):
        return self._batches

    def __getitem__(self, i):
        return _batch([2 * i, 2 * i + 1])


def test_num_batches_only_source_trains_with_fit():
    seq = Counted(batches=5)
    assert not hasattr(seq, "__len__")
    ds = kerasfeed.to_dataset(seq)
    assert int(ds.cardinality()) == 5
    assert _recording_fit(ds, epochs=2) == _recording_fit(Counted(batches=5), epochs=2, shuffle=False)


def test_infinite_source_trains_with_fit_and_counts_up():
    ds = kerasfeed.to_dataset(Counted(batches=None))
    assert int(ds.cardinality()) == tf.data.INFINITE_CARDINALITY
    seen = _recording_fit(ds, epochs=2, steps_per_epoch=3)
    # Keras keeps one iterator across the epochs of a fit: the indices go on counting.
    assert seen == [[2 * i, 2 * i + 1] for i in range(6)]
    assert seen == _recording_fit(Counted(batches=None), epochs=2, steps_per_epoch=3)
    with pytest.raises(ValueError, match="shuffle=True` needs a finite source.*num_batches is None"):
        kerasfeed.to_dataset(Counted(batches=None), shuffle=True)


def test_infinite_source_on_processes_crosses_blocks():
    from kerasfeed.loading.endless import BLOCK

    seq = Counted(batches=None)
    ex = ProcessExecutor(seq, workers=2, seed=0)
    try:
        it = iter(kerasfeed.to_dataset(seq, executor=ex))
        firsts = [int(next(it)[0][0, 0]) for _ in range(BLOCK + 20)]
        assert firsts == [2 * i for i in range(BLOCK + 20)]
    finally:
        ex.close()


class ShortMiddle(kerasfeed.SceneSequence):
    """Batches of 8, 8, 8, 5, 8, 8: the short one is not probed."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        n = 5 if i == 3 else 8
        return np.full((n, 2), i, np.float32), np.zeros((n, 1), np.float32)


def test_short_batch_mid_pass_is_yielded():
    ds = kerasfeed.to_dataset(ShortMiddle())
    assert ds.element_spec[0].shape.as_list() == [None, 2]
    assert [int(x.shape[0]) for x, _ in ds] == [8, 8, 8, 5, 8, 8]
    pinned = kerasfeed.to_dataset(
        ShortMiddle(), output_signature=(tf.TensorSpec([8, 2], tf.float32), tf.TensorSpec([8, 1], tf.float32))
    )
    with pytest.raises(tf.errors.OpError, match=r"Item 3, field x: expected shape \(8, 2\), received shape \(5, 2\)"):
        list(pinned)


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_to_loader_yields_a_short_batch_mid_pass_like_to_dataset(executor):
    # The loader kept the probed batch size fixed and refused item 3 (SignatureError).
    kw = {"workers": 2} if executor == "processes" else {}
    with kerasfeed.to_loader(ShortMiddle(), executor=executor, **kw) as loader:
        batches = list(loader)
        assert [x.shape for x, _ in batches] == [(n, 2) for n in (8, 8, 8, 5, 8, 8)]
        assert [float(x[0, 0]) for x, _ in batches] == [0, 1, 2, 3, 4, 5]
        assert [tuple(s.shape.as_list()) for s in loader.get_tf_dataset().element_spec] == [(None, 2), (None, 1)]


class ExceptionPyDataset(keras.utils.PyDataset):
    """Keras' own scenario (its py_dataset_adapter tests): batches 0 and 1, then an error."""

    @property
    def num_batches(self):
        return 4

    def __getitem__(self, index):
        if index < 2:
            return np.full((8, 4), index, np.float32), np.zeros((8, 2), np.float32)
        raise ValueError("Expected exception")


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_exception_pydataset_yields_the_batches_before_its_error_as_keras_does(executor):
    signature = (tf.TensorSpec((8, 4), tf.float32), tf.TensorSpec((8, 2), tf.float32))
    kw = {"workers": 2} if executor == "processes" else {}
    ds = kerasfeed.to_dataset(ExceptionPyDataset(), output_signature=signature, executor=executor, **kw)
    try:
        assert ds._kerasfeed_group_items > 1  # grouped, yet each batch comes on its own
        it = iter(ds)
        assert [float(next(it)[0][0, 0]) for _ in range(2)] == [0.0, 1.0]
        with pytest.raises(tf.errors.OpError, match=r"ExceptionPyDataset\[2\] raised ValueError.*Expected exception"):
            next(it)
    finally:
        kerasfeed.executor_of(ds).close()
    # Without a signature, item 2 is one of the probed items: to_dataset() itself names it, before any batch.
    with pytest.raises(kerasfeed.ItemError, match=r"ExceptionPyDataset\[2\] raised ValueError.*Expected exception"):
        kerasfeed.to_dataset(ExceptionPyDataset(), executor=executor, **kw)


def test_non_indexable_sources_say_what_is_missing():
    with pytest.raises(TypeError) as info:
        kerasfeed.to_dataset(42)
    msg = str(info.value)
    assert "has no `__getitem__` and no length" in msg and msg.endswith("Received: 42 of type int")
    assert "SceneSequence" not in msg and "PyDataset" not in msg

    class Neither(keras.utils.PyDataset):
        def __getitem__(self, i):
            return _batch([i])

    with pytest.raises(TypeError, match=r"Neither has no length \(neither `__len__` nor a `num_batches` property\)"):
        kerasfeed.to_dataset(Neither())


def test_state_sync_benchmark_prints_the_cost_per_pass(capsys):
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from benchmarks import costs

    costs.main(["state-sync", "--mb", "2", "--passes", "2", "--no-passes"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "ms" not in line and "---" not in line]
    assert len(rows) == 5 and all(float(r.split("|")[2]) >= 0 for r in rows)
    changed = [r for r in rows if "changed in place" in r][0]
    assert int(changed.split("|")[4].replace(",", "")) > 2 * 2**20  # the changed array was sent


class _ViewsChangedByHooks(kerasfeed.SceneSequence):
    """Items are views of one table, which ``on_epoch_end`` overwrites in place (a Keras habit)."""

    def __init__(self, rows=8, width=16):
        super().__init__()
        self.rows, self.width = rows, width
        self.table = np.repeat(np.arange(rows, dtype=np.float32), width)[:, None] * np.ones(4, np.float32)

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        return self.table[i * self.width : (i + 1) * self.width]

    def on_epoch_end(self):
        self.table[:] = -1


@pytest.mark.parametrize("mixed", [False, True], ids=["sequence", "mix-of-two"])
@pytest.mark.parametrize("width", [16, 8192], ids=["grouped", "one-by-one"])
def test_items_waiting_in_tensorflow_s_buffers_survive_on_epoch_end_changing_their_arrays(width, mixed):
    # TensorFlow keeps a numpy_function's arrays without a copy: items of the pass still in its
    # buffers (the consumer is slow here) viewed the table the hook overwrites. A mix runs its
    # parts' hooks from its own.
    rows = 4 if mixed else 8
    seq = _ViewsChangedByHooks(rows=rows, width=width)
    if mixed:
        seq = kerasfeed.mix([seq, _ViewsChangedByHooks(rows=rows, width=width)])
    ds = kerasfeed.to_dataset(seq, executor="threads")
    assert (kerasfeed.executor_of(ds) is not None) and (ds._kerasfeed_group_items > 1) == (width == 16)
    firsts = []
    for b in ds:
        time.sleep(0.05)  # TensorFlow's prefetch and the executor run ahead meanwhile
        firsts.append(float(b[0, 0]))
    assert firsts == [float(i) for i in range(rows) for _ in range(2 if mixed else 1)]


def test_only_the_user_s_own_epoch_hooks_make_to_dataset_copy_views():
    from kerasfeed.loading.pipeline import PassPipeline
    from kerasfeed.sources.base import has_own_epoch_hooks

    class Plain(kerasfeed.SceneSequence):  # kerasfeed's default hooks only
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return np.zeros(2)

    class Bare:  # no hooks at all
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return np.zeros(2)

    bare_with_hook = Bare()
    bare_with_hook.on_epoch_end = lambda: None
    assert not has_own_epoch_hooks(Plain()) and not has_own_epoch_hooks(Bare())
    assert has_own_epoch_hooks(_ViewsChangedByHooks()) and has_own_epoch_hooks(bare_with_hook)
    # A mix's hooks are kerasfeed's, but they run its parts' own: one such part is enough.
    assert not has_own_epoch_hooks(kerasfeed.mix([Plain(), Bare()], check=False))
    assert not has_own_epoch_hooks(kerasfeed.mix([np.zeros((2, 2)), Bare()], check=False))
    assert has_own_epoch_hooks(kerasfeed.mix([Plain(), _ViewsChangedByHooks()], check=False))
    assert has_own_epoch_hooks(kerasfeed.mix([np.zeros((8, 16, 4)), bare_with_hook, Bare()], check=False))
    for seq in (_ViewsChangedByHooks(width=8192), kerasfeed.mix([np.zeros((8, 8192, 4), np.float32), _ViewsChangedByHooks(width=8192)])):
        for executor, copies in (("threads", True), ("processes", False)):
            ds = kerasfeed.to_dataset(seq, executor=executor, **({"workers": 1} if executor == "processes" else {}))
            assert isinstance(ds._kerasfeed_pipeline, PassPipeline)
            assert ds._kerasfeed_pipeline._copy_views is copies, (executor, type(seq).__name__)
            kerasfeed.executor_of(ds).close()
