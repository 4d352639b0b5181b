"""Argument checks: the same bad value gets the same message from every entry point, up front."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

import kerasfeed
from kerasfeed import ProcessExecutor
from kerasfeed import _validation as v
from kerasfeed.datasets import make_synthetic_scenes
from kerasfeed.execution.processes.options import PoolOptions
from kerasfeed.execution.threads import ThreadExecutor


class Small(kerasfeed.SceneSequence):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return np.full((2,), i, np.float32)


def one_item(i):
    yield np.full((2,), i, np.float32)


def read_one(path):
    yield np.zeros((2,), np.float32)


@pytest.fixture(scope="module")
def h5file(tmp_path_factory):
    return make_synthetic_scenes(tmp_path_factory.mktemp("v") / "s.h5", num_scenes=4, points_per_scene=8, seed=0)


# Each entry point with the keyword under test; `h5` is filled in by the test.
ENTRY_POINTS = {
    "to_dataset": lambda h5, **kw: kerasfeed.to_dataset(Small(), **kw),
    "to_dataset/processes": lambda h5, **kw: kerasfeed.to_dataset(Small(), executor="processes", **kw),
    "to_loader": lambda h5, **kw: kerasfeed.to_loader(Small(), **kw),
    "to_loader/processes": lambda h5, **kw: kerasfeed.to_loader(Small(), executor="processes", **kw),
    "export": lambda h5, **kw: kerasfeed.export(Small(), h5.parent / "never", num_shards=1, progress=False, **kw),
    "from_generators": lambda h5, **kw: kerasfeed.from_generators(one_item, 2, **kw),
    "from_files": lambda h5, **kw: kerasfeed.from_files(["a", "b"], read_one, **kw),
    "from_queue": lambda h5, **kw: kerasfeed.from_queue(lambda put: None, **kw),
    "ProcessExecutor": lambda h5, **kw: ProcessExecutor(Small(), **kw),
    "H5SliceSequence": lambda h5, **kw: kerasfeed.H5SliceSequence(h5, "points", batch_size=2, **kw),
}

# (keyword arguments, the message every entry point gives, entry points that take them)
BAD = [
    (dict(workers=0), "`workers` must be a positive int. Received: workers=0",
     ["to_dataset/processes", "from_generators", "from_files", "ProcessExecutor"]),
    (dict(workers=2.0), "`workers` must be a positive int. Received: workers=2.0",
     ["to_dataset/processes", "from_generators", "from_files", "ProcessExecutor"]),
    (dict(seed=-1), "`seed` must be None or an int in [0, 2**64). Received: seed=-1",
     ["to_dataset", "to_dataset/processes", "from_generators", "from_files", "from_queue", "ProcessExecutor",
      "H5SliceSequence"]),
    (dict(seed=2**64), f"`seed` must be None or an int in [0, 2**64). Received: seed={2**64}",
     ["to_dataset", "from_generators", "from_files", "ProcessExecutor", "H5SliceSequence"]),
    (dict(seed="1"), "`seed` must be None or an int in [0, 2**64). Received: seed='1'",
     ["to_dataset", "from_generators", "ProcessExecutor", "H5SliceSequence"]),
    (dict(timeout=0), "`timeout` must be a positive number of seconds (or None). Received: timeout=0",
     ["ProcessExecutor", "from_queue"]),
    (dict(drop_remainder="yes", batch_size=2), "`drop_remainder` must be True or False. Received: drop_remainder='yes'",
     ["to_dataset", "from_generators", "from_files", "from_queue"]),
    (dict(shuffle="yes"), "`shuffle` must be True or False. Received: shuffle='yes'", ["to_dataset", "H5SliceSequence"]),
    (dict(deterministic="yes"), "`deterministic` must be True or False. Received: deterministic='yes'",
     ["from_generators", "from_files"]),
    (dict(prefetch=-2), "`prefetch` must be a non-negative int or tf.data.AUTOTUNE. Received: prefetch=-2",
     ["to_dataset", "from_generators", "from_files", "from_queue"]),
    # The long-run options (issue 40): retries, recycled workers, the skip budget.
    (dict(retries=-1), "`retries` must be a non-negative int. Received: retries=-1",
     ["to_dataset", "to_dataset/processes", "to_loader", "to_loader/processes", "export", "ProcessExecutor"]),
    (dict(retries=1.0), "`retries` must be a non-negative int. Received: retries=1.0",
     ["to_dataset", "to_loader", "export", "ProcessExecutor"]),
    (dict(worker_max_items=0), "`worker_max_items` must be a positive int. Received: worker_max_items=0",
     ["to_dataset/processes", "to_loader/processes", "export", "ProcessExecutor"]),
    (dict(worker_max_rss=2**20), "would replace workers after every item. Received: worker_max_rss=1048576",
     ["to_dataset/processes", "to_loader/processes", "export", "ProcessExecutor"]),
    (dict(max_skipped=-1), "`max_skipped` must be a non-negative int (0: no item is left out) or a float in (0, 1). "
     "Received: max_skipped=-1", ["to_dataset", "to_dataset/processes", "to_loader", "to_loader/processes"]),
    (dict(max_skipped=1.0), "`max_skipped` as a float is a fraction of a pass and must be in (0, 1); give an int for a "
     "count of items. Received: max_skipped=1.0", ["to_dataset", "to_loader"]),
    (dict(max_skipped="1"), "`max_skipped` must be an int (items a pass may leave out; 0: none) or a float in (0, 1) "
     "(a fraction of a pass). Received: max_skipped='1'", ["to_dataset", "to_loader"]),
]
CASES = [pytest.param(kw, msg, name, id=f"{name}-{next(iter(kw))}={kw[next(iter(kw))]!r}") for kw, msg, names in BAD for name in names]


@pytest.mark.parametrize("kwargs, message, entry", CASES)
def test_same_bad_value_same_message_from_every_entry_point(kwargs, message, entry, h5file):
    with pytest.raises((TypeError, ValueError)) as e:
        ENTRY_POINTS[entry](h5file, **kwargs)
    # The HDF5 readers prefix their class name; the rest is the same everywhere.
    assert str(e.value).endswith(message), str(e.value)
    if entry == "H5SliceSequence":
        assert str(e.value) == f"H5SliceSequence: {message}"


@pytest.mark.parametrize("entry", ["to_dataset", "to_dataset/processes", "from_generators", "from_files"])
def test_a_device_name_tensorflow_cannot_parse_is_refused_with_what_was_passed(entry, h5file):
    with pytest.raises(ValueError, match=r"^`device` must be a device name such as '/gpu:0': .*'bogus'") as e:
        ENTRY_POINTS[entry](h5file, device="/bogus:0")
    assert str(e.value).endswith("Received: device='/bogus:0'")


def test_a_device_this_process_lacks_is_warned_about_or_refused_in_kerasfeed_s_words(caplog):
    """Before: ``device="/gpu:7"`` on a machine without it ran on the CPU without a word, and a device of a job
    this process is not raised TensorFlow's bare ``InvalidArgumentError`` from deep in tf.data."""
    import logging

    with caplog.at_level(logging.WARNING, logger="kerasfeed"):
        ds = kerasfeed.to_dataset(np.zeros((4, 2), np.float32), device="/gpu:7")
    assert len(list(ds)) == 4  # still runs: a script written for a GPU runs on this CPU
    warned = [r.getMessage() for r in caplog.records]
    assert any("device='/gpu:7' names no device of this process (its GPU devices: none)" in m for m in warned), warned
    with pytest.raises(ValueError, match=r"^`device` names a device the prefetch cannot be placed on: Could not "
                                         r"satisfy device specification .*Received: device='/job:worker/task:0/cpu:0'$"):
        kerasfeed.to_dataset(np.zeros((4, 2), np.float32), device="/job:worker/task:0/cpu:0")


@pytest.mark.parametrize("text", ["scenes.h5", b"scenes.h5", bytearray(b"ab")])
def test_text_is_refused_as_a_source_by_every_front_end(text, tmp_path):
    # A path passed where a source belongs is indexable: without the check its characters were the items.
    front_ends = {
        "to_dataset": lambda: kerasfeed.to_dataset(text),
        "to_loader": lambda: kerasfeed.to_loader(text),
        "export": lambda: kerasfeed.export(text, tmp_path / "out", num_shards=1),
        "mix": lambda: kerasfeed.mix([Small(), text]),
        "profile": lambda: kerasfeed.profile(text),
    }
    for name, call in front_ends.items():
        with pytest.raises(TypeError, match=r"needs an indexable source of items, not text") as info:
            call()
        assert str(info.value).endswith(f"Received: {text!r} of type {type(text).__name__}"), name


class Thousands(Small):
    def __getitem__(self, i):
        return np.full((2,), 1000 + i, np.float32)


def test_an_executor_instance_reads_only_its_own_source():
    # Another source's executor served its own items under the new source's indices (0.0.. for 1000..).
    train = Small()
    for ex in (ProcessExecutor(train, workers=1), kerasfeed.to_loader(train, executor="threads").executor):
        with ex:
            for front_end in (kerasfeed.to_dataset, kerasfeed.to_loader):
                with pytest.raises(ValueError, match=r"The executor given runs another source \(Small at .*\) than the "
                                   r"one to read \(Thousands at .*\).*Received: executor=<"):
                    front_end(Thousands(), executor=ex)
                with pytest.raises(ValueError, match=r"`workers` and `worker_init` apply to an executor kerasfeed "
                                   r"makes.*Received: workers=8, worker_init=None"):
                    front_end(train, executor=ex, workers=8)  # was taken and ignored
            assert [float(x[0]) for x in kerasfeed.to_loader(train, executor=ex)] == [0, 1, 2, 3, 4, 5]
    # A path or a number is no source for the executor either (its items were the path's characters).
    for bad in ("scenes.h5", 5, None):
        with pytest.raises(TypeError, match=rf"^ProcessExecutor needs an indexable source.*Received: {bad!r} of type"):
            ProcessExecutor(bad, workers=1)


def test_a_pipeline_seed_beside_an_executor_instance_with_another_item_seed_is_warned_about():
    """The pipeline's seed orders the items; item_rng() draws from the executor's own: an executor made
    without that seed gave other random numbers than executor='...' with it, and others every run."""
    train = Small()
    for make in (lambda **kw: ProcessExecutor(train, workers=1, **kw), lambda **kw: ThreadExecutor(train, **kw)):
        with make() as ex:
            with pytest.warns(UserWarning, match=r"seed=3 orders the items, but kerasfeed.item_rng\(\).*drawn when it "
                              r"was made.*Make the executor with seed=3 too. Received: seed=3, executor=<") as got:
                kerasfeed.to_loader(train, shuffle=True, seed=3, executor=ex)
            assert got[0].filename == __file__  # names the caller's line
        with make(seed=4) as ex:
            with pytest.warns(UserWarning, match=r"executor's own seed, 4: .* with seed=3\. Make the executor"):
                kerasfeed.to_dataset(train, shuffle=True, seed=3, executor=ex)
            with warnings.catch_warnings():  # once per executor
                warnings.simplefilter("error")
                kerasfeed.to_loader(train, shuffle=True, seed=3, executor=ex)
        with make(seed=3) as ex, warnings.catch_warnings():
            warnings.simplefilter("error")
            kerasfeed.to_loader(train, shuffle=True, seed=3, executor=ex)
            kerasfeed.to_loader(train, executor=ex)  # no seed of the pipeline's: nothing to differ from


def test_a_seed_numpy_refuses_fails_when_the_dataset_is_made_not_mid_iteration():
    # On threads the permutation is drawn in the first pass, inside tf.data:
    # the seed must be refused before that, with the same message as processes.
    for executor in ("threads", "processes"):
        with pytest.raises(ValueError, match=re.escape("`seed` must be None or an int in [0, 2**64). Received: seed=-1")):
            kerasfeed.to_dataset(Small(), shuffle=True, seed=-1, executor=executor)
    # The largest seed numpy takes is fine, on both executors and for the orders.
    top = np.uint64(2**64 - 1)
    ds = kerasfeed.to_dataset(Small(), shuffle=True, seed=top, batch_size=6)
    assert sorted(next(iter(ds)).numpy()[:, 0].tolist()) == [0, 1, 2, 3, 4, 5]
    assert sorted(kerasfeed.IndexOrder(6, shuffle=True, seed=top).indices(0).tolist()) == [0, 1, 2, 3, 4, 5]


def test_numpy_integer_workers_are_taken_by_every_entry_point():
    w = np.int64(2)
    gen = kerasfeed.from_generators(one_item, 4, workers=w, batch_size=4)
    assert sorted(next(iter(gen)).numpy()[:, 0].tolist()) == [0, 1, 2, 3]
    files = kerasfeed.from_files(["a", "b"], read_one, workers=w, batch_size=2)
    assert next(iter(files)).shape == (2, 2)
    ds = kerasfeed.to_dataset(Small(), executor="processes", workers=w, batch_size=6)
    try:
        assert kerasfeed.executor_of(ds).workers == 2 and type(kerasfeed.executor_of(ds).workers) is int
        assert next(iter(ds)).numpy()[:, 0].tolist() == [0, 1, 2, 3, 4, 5]
    finally:
        kerasfeed.executor_of(ds).close()
    assert PoolOptions(workers=np.int32(3), seed=np.uint64(5)).resolved() == PoolOptions(workers=3, seed=5)


def test_pool_options_resolve_defaults_once():
    opts = PoolOptions()
    assert opts.workers is None and opts.seed is None and not opts.given
    r = opts.resolved()
    assert r.workers >= 1 and isinstance(r.seed, int) and r.resolved() == r
    assert PoolOptions(worker_init=print).given
    with pytest.raises(TypeError, match=r"`worker_init` must be a callable or None. Received: worker_init=3"):
        PoolOptions(worker_init=3)
    with pytest.raises(ValueError, match=r"`workers` and `worker_init` apply to worker processes"):
        kerasfeed.to_dataset(Small(), workers=2)


@pytest.mark.parametrize(
    "check, args, ok",
    [
        (v.positive_int, ("n", np.int8(3)), 3),
        (v.non_negative_int, ("n", np.uint16(0)), 0),
        (v.flag, ("f", np.bool_(True)), True),
        (v.seed, ("seed", np.uint64(2**64 - 1)), 2**64 - 1),
        (v.seconds, ("timeout", np.float32(0.5)), 0.5),
        (v.positive_float, ("x", 2), 2.0),
    ],
)
def test_checks_normalize_numpy_values_to_python(check, args, ok):
    out = check(*args)
    assert out == ok and type(out) is type(ok)


@pytest.mark.parametrize(
    "check, args, message",
    [
        (v.positive_int, ("n", True), "`n` must be a positive int. Received: n=True"),
        (v.non_negative_int, ("n", -1), "`n` must be a non-negative int. Received: n=-1"),
        (v.flag, ("f", 1), "`f` must be True or False. Received: f=1"),
        (v.seconds, ("t", float("inf")), "`t` must be a positive number of seconds (or None). Received: t=inf"),
        (v.positive_float, ("x", float("nan")), "`x` must be a positive number. Received: x=nan"),
    ],
)
def test_checks_refuse_with_what_was_received(check, args, message):
    with pytest.raises((TypeError, ValueError)) as e:
        check(*args)
    assert str(e.value) == message


class MixedKeys(Small):
    def __getitem__(self, i):
        return np.zeros(2, np.float32), ({"b": {2: np.ones(1), "c": 1}} if i == 3 else {"b": {"c": np.ones(1)}})


@pytest.mark.parametrize("front_end", ["to_dataset", "to_loader"])
def test_dict_keys_that_do_not_sort_are_named_with_the_item(front_end):
    # sorted() raised a bare "'<' not supported between instances of 'str' and 'int'", no item named.
    with pytest.raises(kerasfeed.SignatureError, match=re.escape(
            "Item 3 has a dict at [1]['b'] whose keys do not sort together (items are read in sorted key order, "
            "as tf.nest does): use keys of one type, e.g. all str. Received: keys=[2, 'c']")):
        getattr(kerasfeed, front_end)(MixedKeys(), probe=6)


class BigEndianAt4(Small):
    def __getitem__(self, i):
        return np.full((2,), i, ">f4" if i == 4 else "<f4")


def test_an_item_in_another_byte_order_is_handed_over_natively():
    # It was refused ("expected dtype <f4, received >f4"; before that "float32, received float32"): the same
    # numbers in another byte order. Both front ends now hand every array over in native byte order.
    want = [np.full((2,), i, np.float32) for i in range(len(BigEndianAt4()))]
    loaded = list(kerasfeed.to_loader(BigEndianAt4(), probe=2))
    assert all(a.dtype.str == "<f4" and np.array_equal(a, w) for a, w in zip(loaded, want)) and len(loaded) == len(want)
    fed = [t.numpy() for t in kerasfeed.to_dataset(BigEndianAt4(), probe=2)]
    assert all(a.dtype == np.float32 and np.array_equal(a, w) for a, w in zip(fed, want)) and len(fed) == len(want)


@pytest.mark.parametrize("state", [{}, 0, False, [], ""])
def test_only_none_is_a_fresh_start(state):
    # A falsy initial_state was taken as {"epoch": 0, "batches": 0} in silence.
    for front_end in (kerasfeed.to_loader, kerasfeed.to_dataset, kerasfeed.TrainingProgress):
        with pytest.raises(ValueError, match=rf"A resume state is a dict with exactly the keys .* Received: {re.escape(repr(state))}$"):
            front_end(state) if front_end is kerasfeed.TrainingProgress else front_end(Small(), initial_state=state)


def test_the_long_run_options_keep_fail_fast_by_default_and_name_what_does_not_apply(tmp_path):
    # Defaults: no retries, nothing skipped, no recycling (today's fail-fast behaviour).
    for front_end in (kerasfeed.to_dataset, kerasfeed.to_loader):
        data = front_end(Small(), batch_size=2)
        assert kerasfeed.stats(data)["skipped"] == 0
    # Worker limits recycle worker processes: refused on threads, naming both.
    for front_end in (kerasfeed.to_dataset, kerasfeed.to_loader):
        with pytest.raises(ValueError, match=r"`worker_max_items` and `worker_max_rss` recycle worker processes.*"
                           r"Received: worker_max_items=3, worker_max_rss=None"):
            front_end(Small(), worker_max_items=3)
    # A fraction of a pass needs a pass; an export writes every item.
    class Endless(kerasfeed.SceneSequence):
        @property
        def num_batches(self):
            return None

        def __getitem__(self, i):
            return np.full((2,), i, np.float32)

    with pytest.raises(ValueError, match=r"`max_skipped` as a fraction of a pass needs a finite source.*"
                       r"Received: max_skipped=0.1"):
        kerasfeed.to_dataset(Endless(), max_skipped=0.1)
    with pytest.raises(ValueError, match=r"^export: `max_skipped` must be 0: an export writes every item.*"
                       r"Received: max_skipped=1$"):
        kerasfeed.export(Small(), tmp_path / "e", num_shards=1, max_skipped=1, progress=False)
    assert not (tmp_path / "e").exists()  # refused before anything was written


@pytest.mark.parametrize("empty", [(), {}])
def test_an_item_that_holds_no_array_is_refused_alike_by_every_front_end(empty):
    """to_dataset raised a bare "'Operation' object is not iterable" (and blamed the TensorFlow version),
    from_generators a proto dump, and to_loader yielded empty items (helper, 3 of 3)."""
    from kerasfeed.errors import SignatureError

    class Empty:
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return empty

    message = rf"^Item 0 holds no array \(it is {re.escape(repr(empty))}\): .* Received: item 0="
    for make in (kerasfeed.to_dataset, kerasfeed.to_loader, lambda s: kerasfeed.to_dataset(s, batch_size=2)):
        with pytest.raises(SignatureError, match=message):
            make(Empty())
    with pytest.raises(SignatureError, match=r"holds no array"):
        kerasfeed.from_generators(lambda k: iter([empty, empty]), 1)
