"""The keyword arguments the HDF5 sequences share: declared once, checked by name, kept flat."""

import dataclasses

import pytest

import kerasfeed
from kerasfeed.datasets import make_synthetic_scenes
from kerasfeed.hdf5.options import H5Keywords, H5Options


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_synthetic_scenes(tmp_path_factory.mktemp("h5opts") / "s.h5", num_scenes=12, points_per_scene=8, seed=3)


def test_typed_keywords_match_the_options_fields():
    fields = {f.name: f.type for f in dataclasses.fields(H5Options)}
    # Same names in the same order, and the same (unevaluated) annotations.
    assert list(H5Keywords.__annotations__) == list(fields)
    assert {k: getattr(v, "__forward_arg__", v) for k, v in H5Keywords.__annotations__.items()} == fields


def test_flat_keywords_reach_every_sequence(path):
    def noisy(batch, rng):
        return batch[0] + rng.standard_normal(batch[0].shape).astype("float32"), batch[1]

    common = dict(seed=7, drop_remainder=True, transform=noisy, open_kwargs={"rdcc_nbytes": 1 << 20}, workers=2, max_queue_size=3)
    seqs = [
        kerasfeed.H5SliceSequence(path, ("points", "labels"), 5, shuffle=True, **common),
        kerasfeed.H5WindowSequence(path, ("points", "labels"), 5, window=2, shuffle=True, **common),
        kerasfeed.H5RowSequence(path, ("points", "labels"), 5, order=kerasfeed.IndexOrder(12, shuffle=True, seed=1), **common),
    ]
    for seq in seqs:
        assert (seq.seed, seq.drop_remainder, seq.transform, seq.workers, seq.max_queue_size) == (7, True, noisy, 2, 3)
        assert seq._open_kwargs == {"rdcc_nbytes": 1 << 20}
        x, y = seq[len(seq) - 1]
        assert x.shape[0] == 5  # the short last batch is dropped
    assert seqs[0].shuffle and seqs[1].shuffle and not seqs[2].shuffle
    # Without a seed of its own the row sequence takes the order's.
    assert kerasfeed.H5RowSequence(path, "labels", 4, order=kerasfeed.IndexOrder(12, seed=9)).seed == 9


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: kerasfeed.H5SliceSequence(p, "labels", 4, shufle=True), "H5SliceSequence got an unexpected keyword argument `shufle`"),
        (lambda p: kerasfeed.H5WindowSequence(p, "labels", 4, window=2, strides=2), "H5WindowSequence got an unexpected keyword argument `strides`"),
        (lambda p: kerasfeed.H5RowSequence(p, "labels", 4, order=kerasfeed.IndexOrder(12), shuffle=True), "H5RowSequence does not take `shuffle`: the order picks the rows"),
    ],
)
def test_unknown_or_refused_keywords_are_named(path, make, message):
    with pytest.raises(TypeError) as info:
        make(path)
    assert message in str(info.value) and "Received: " in str(info.value)


def test_shared_values_are_checked_by_every_sequence(path):
    for make in (
        lambda **kw: kerasfeed.H5SliceSequence(path, "labels", 4, **kw),
        lambda **kw: kerasfeed.H5WindowSequence(path, "labels", 4, window=2, **kw),
        lambda **kw: kerasfeed.H5RowSequence(path, "labels", 4, order=kerasfeed.IndexOrder(12), **kw),
    ):
        with pytest.raises(ValueError, match=r"Received: seed=-1"):
            make(seed=-1)
        with pytest.raises(TypeError, match=r"`transform` must be a callable"):
            make(transform=3)
        with pytest.raises(ValueError, match=r"may not set 'swmr'"):
            make(open_kwargs={"swmr": True})
        # Keras reads these only in model.fit(seq): a bare TypeError there, or a hang (helper, 2 of 2).
        for name, value in (("workers", "2"), ("workers", 2.5), ("max_queue_size", "a"), ("max_queue_size", 0)):
            with pytest.raises(ValueError, match=rf"Sequence: `{name}` must be a .*int. Received: {name}={value!r}"):
                make(**{name: value})


def _rows_read(seq_of, pipeline):
    """Rows read by two pipelines' shards, each over its own copy of the sequence (one per worker)."""
    return [[int(v) for batch in pipeline(seq_of(), k) for v in batch] for k in range(2)]


def test_sharded_pipelines_over_reader_copies_read_disjoint_rows_or_are_refused(tmp_path):
    import h5py
    import numpy as np
    import tensorflow as tf

    path = tmp_path / "rows.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("labels", data=np.arange(12), chunks=(3,))  # a row's number

    def dataset(seq, k):
        return kerasfeed.to_dataset(seq, input_context=tf.distribute.InputContext(2, k))

    def loader(seq, k):
        return kerasfeed.to_loader(seq, num_shards=2, shard_index=k, executor="threads")

    for pipeline in (dataset, loader):
        # A seed shared by the copies: disjoint shards, every row read once.
        a, b = _rows_read(lambda: kerasfeed.H5SliceSequence(path, "labels", 3, shuffle=True, seed=5), pipeline)
        assert not set(a) & set(b) and len(a) + len(b) == 12
        # A seed drawn per copy would order each copy differently: the shards would overlap.
        for make in (
            lambda: kerasfeed.H5SliceSequence(path, "labels", 3, shuffle=True),
            lambda: kerasfeed.H5SliceSequence(path, "labels", 3, shuffle_window_chunks=1),
            lambda: kerasfeed.H5WindowSequence(path, "labels", 3, window=2, shuffle=True),
        ):
            with pytest.raises(ValueError) as info:
                pipeline(make(), 0)
            assert "cannot be cut into 2 disjoint shards" in str(info.value)
            assert str(info.value).endswith("Pass the same seed= on every worker. Received: seed=None")
        # Unshuffled, or with nothing to cut: no seed needed.
        pipeline(kerasfeed.H5SliceSequence(path, "labels", 3), 0)
        kerasfeed.to_loader(kerasfeed.H5SliceSequence(path, "labels", 3, shuffle=True), executor="threads")

    # An order that is one shard already: cutting its batches again would leave rows unread.
    def rows(k):
        return kerasfeed.H5RowSequence(path, "labels", 2, order=kerasfeed.IndexOrder(12, shuffle=True, seed=4,
                                                                                       num_shards=2, shard_index=k))
    with pytest.raises(ValueError, match=r"its order is one shard already.*Pass num_shards=1.*Received: order=IndexOrder"):
        dataset(rows(0), 0)
    # An order that drew its own seed: each worker's would be another permutation of the rows.
    for order in (kerasfeed.IndexOrder(12, shuffle=True), kerasfeed.WeightedOrder(np.ones(12))):
        for pipeline in (dataset, loader):
            with pytest.raises(ValueError, match=r"its order drew a seed of its own \(seed=None\).*Pass the same "
                               r"seed= to the order on every worker\. Received: order="):
                pipeline(kerasfeed.H5RowSequence(path, "labels", 2, order=order), 0)
    for order_of in (lambda: kerasfeed.IndexOrder(12), lambda: kerasfeed.IndexOrder(12, shuffle=True, seed=1)):
        # each worker's order made anew, with nothing drawn to differ: every row read once
        a, b = _rows_read(lambda: kerasfeed.H5RowSequence(path, "labels", 2, order=order_of()), loader)
        assert sorted(a + b) == list(range(12))
    whole = [[int(v) for batch in kerasfeed.to_loader(rows(k), num_shards=1, executor="threads") for v in batch]
             for k in range(2)]
    assert sorted(whole[0] + whole[1]) == list(range(12))


def test_open_kwargs_that_h5py_refuses_are_named_not_blamed_on_the_file(path):
    for bad, said in (({"rdcc_nbytes": "64MB"}, "an integer is required"), ({"rdcc_nbyts": 1}, "rdcc_nbyts")):
        with pytest.raises(TypeError) as info:
            kerasfeed.H5SliceSequence(path, "labels", 4, open_kwargs=bad)
        msg = str(info.value)
        assert "h5py.File refused `open_kwargs`" in msg and said in msg and "corrupt" not in msg, msg
        assert msg.endswith(f"Received: open_kwargs={bad!r}")
