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
