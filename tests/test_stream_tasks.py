"""What a stream's task returns: a generator runs once, so a factory or a
``read_fn`` that hands back a generator made ahead is refused by name instead
of giving streams without items (threads and worker processes)."""

import numpy as np
import pytest
import tensorflow as tf

import kerasfeed

INT = tf.TensorSpec([], tf.int64)
REUSED = "returned a generator object it had returned before"


def _counting(i, n=3):
    for k in range(n):
        yield np.int64(i * 10 + k)


def test_generators_made_ahead_fail_the_pass_that_would_be_empty():
    """With a signature given, the first pass reads them; the second is refused
    instead of coming out empty."""
    gens = [_counting(i) for i in range(3)]
    ds = kerasfeed.from_generators(lambda i: gens[i], 3, cycle_length=1, output_signature=INT)
    assert [int(v) for v in ds] == [0, 1, 2, 10, 11, 12, 20, 21, 22]
    with pytest.raises(tf.errors.OpError, match=rf"<lambda>\(0\) \(generator shard 0 of 3\) raised ValueError after 0 items: the task {REUSED}.*Received: <generator object _counting"):
        list(ds)


def test_generators_made_ahead_are_refused_after_the_signature_probe():
    """The probe is already a first read: without a signature the first pass
    fails, where before it gave no items at all."""
    gens = [_counting(i) for i in range(4)]
    ds = kerasfeed.from_generators(lambda i: gens[i], 4)
    with pytest.raises(tf.errors.OpError, match=REUSED):
        list(ds)


def test_one_generator_for_every_shard_is_refused_while_probing():
    shared = _counting(0, n=100)
    with pytest.raises(kerasfeed.StreamError, match=rf"\(generator shard 1 of 3\) raised ValueError after 0 items: the task {REUSED}"):
        kerasfeed.from_generators(lambda i: shared, 3)


def test_new_generators_lists_and_restartable_iterables_still_run_every_pass():
    class Restarting:  # ``__iter__`` returns a new generator: the same object every call is fine
        def __init__(self, i):
            self.i = i

        def __iter__(self):
            return _counting(self.i)

    made = [Restarting(i) for i in range(2)]
    lists = [[np.int64(i)] * 2 for i in range(2)]
    for factory in (_counting, lambda i: made[i], lambda i: lists[i]):
        ds = kerasfeed.from_generators(factory, 2, cycle_length=1)
        first = [int(v) for v in ds]
        assert first and [int(v) for v in ds] == first


def test_a_read_fn_returning_a_cached_generator_names_the_file(tmp_path):
    paths = []
    for i in range(2):
        paths.append(str(tmp_path / f"part-{i}.txt"))
        with open(paths[-1], "w") as fh:
            fh.write("1\n2\n")
    cache = {}

    def read(path):
        if path not in cache:
            cache[path] = (np.int64(line) for line in open(path).read().split())
        return cache[path]

    ds = kerasfeed.from_files(paths, read, output_signature=INT, cycle_length=1)
    assert [int(v) for v in ds] == [1, 2, 1, 2]
    with pytest.raises(tf.errors.OpError, match=rf"read\('.*part-0.txt'\) \(file 0 of 2\) raised ValueError after 0 items: the task {REUSED}"):
        list(ds)


def test_a_worker_process_refuses_a_generator_it_handed_out_before():
    """In a worker the task is unpickled afresh for every stream; a generator
    kept in the worker's own memory (here: a builtins attribute) comes back
    the second time and is refused there, named with the worker."""

    def cached_in_the_worker(i):
        import builtins

        cache = builtins.__dict__.setdefault("_kerasfeed_test_generators", {})
        if i not in cache:
            cache[i] = (np.int64(i * 10 + k) for k in range(2))
        return cache[i]

    ds = kerasfeed.from_generators(
        cached_in_the_worker, 2, executor="processes", workers=1, cycle_length=1, output_signature=INT
    )
    try:
        assert [int(v) for v in ds] == [0, 1, 10, 11]
        with pytest.raises(tf.errors.OpError, match=rf"cached_in_the_worker\(0\) \(generator shard 0 of 2\) raised ValueError after 0 items in worker .*{REUSED}"):
            list(ds)
    finally:
        ds._kerasfeed_stream.close()


@pytest.mark.parametrize("made", [lambda i: map(np.int64, [10 * i, 10 * i + 1]), lambda i: iter([np.int64(10 * i)] * 2)],
                         ids=["map", "list_iterator"])
def test_other_iterators_made_ahead_are_refused_after_the_probe(made):
    """A map or iter(list) made ahead is its own iterator, as a generator is: the probe read shard 0's
    first items, so the pass would have lost them (pass 0 was [10, 20, 11, 21], pass 1 empty)."""
    its = [made(i) for i in range(3)]
    ds = kerasfeed.from_generators(lambda i: its[i], 3, probe=1)
    with pytest.raises(tf.errors.OpError, match=r"the task returned an iterator it had returned before.*Received: <"):
        list(ds)


def test_iterators_of_types_without_weak_references_are_told_apart():
    from kerasfeed.sources.base import GeneratorsSeen

    seen = GeneratorsSeen()
    kept = [seen.check(iter([1])) for _ in range(3)]  # new iterators each call: all fine, held strongly
    with pytest.raises(ValueError, match="returned an iterator it had returned before"):
        seen.check(kept[1])
    seen.KEPT_STRONG = 2
    for _ in range(5):
        seen.check(iter([1]))
    assert len(seen._held) == 2
