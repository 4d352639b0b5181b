"""Sharding and tf.distribute: several devices, several input pipelines."""

import os
import subprocess
import sys
import textwrap

import numpy as np

import kerasfeed


class Idx:
    def __len__(self):
        return 23

    def __getitem__(self, i):
        return np.int64(i)


def test_shards_are_disjoint_equal_and_reshuffled_per_pass():
    shards = [kerasfeed.to_dataset(Idx(), shuffle=True, seed=5, num_shards=3, shard_index=k) for k in range(3)]
    first = [[int(v) for v in ds] for ds in shards]
    second = [[int(v) for v in ds] for ds in shards]
    for passes in (first, second):
        assert [len(p) for p in passes] == [7, 7, 7]  # 23 // 3, equal steps on every worker
        flat = sum(passes, [])
        assert len(set(flat)) == 21 and set(flat) <= set(range(23))
    assert first != second
    assert int(shards[0].cardinality()) == 7


MIRRORED = textwrap.dedent(
    """
    import numpy as np, tensorflow as tf, keras, kerasfeed
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

    class Seq(kerasfeed.SceneSequence):
        def __len__(self):
            return 8
        def __getitem__(self, i):
            x = np.random.default_rng(i).normal(size=(8, 3)).astype("float32")
            return x, x.sum(axis=1, keepdims=True)

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
    hist = model.fit(kerasfeed.to_dataset(Seq(), shuffle=True, seed=0), epochs=3, verbose=0, shuffle=False)
    loss = hist.history["loss"]
    assert loss[-1] < loss[0], loss

    seen = []
    def dataset_fn(ctx):
        seen.append((ctx.num_input_pipelines, ctx.input_pipeline_id))
        return kerasfeed.to_dataset(Seq(), input_context=ctx, shuffle=True, seed=1)
    dist = strategy.distribute_datasets_from_function(dataset_fn)
    steps = 0
    for x, y in dist:
        per_replica = strategy.experimental_local_results(x)
        assert len(per_replica) == 2
        steps += 1
    assert steps == 4 and seen == [(1, 0)], (steps, seen)
    print("OK", loss[0], loss[-1])
    """
)


def test_mirrored_strategy_on_two_logical_cpus(tmp_path):
    script = tmp_path / "mirrored.py"
    script.write_text(MIRRORED)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]


def test_a_distributed_dataset_s_pipeline_is_found_by_stats_and_executor_of(tmp_path):
    """Before: kerasfeed.stats and executor_of refused the DistributedDataset distribute returns, so nothing
    could close its pipeline, and a notebook cell run again over a kept cache was refused "in use by another
    pipeline of this process" with advice (executor_of(ds).close()) that raised in turn."""
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    for attempt in range(2):
        dist = kerasfeed.distribute(strategy, Idx(), batch_size=4, shuffle=True, seed=0, cache=str(tmp_path / "kept"))
        assert sum(1 for _ in dist) == 6  # 23 items in batches of 4
        stats = kerasfeed.stats(dist)
        # The first attempt made and stored every item; the second read them from the kept directory.
        assert stats["cache_items"] == 23 and stats["cache_misses"] == (23 - 4 if attempt == 0 else 0), stats
        kerasfeed.executor_of(dist).close()  # the directory is free again: the next attempt opens it
