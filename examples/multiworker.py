"""Multi-worker training with kerasfeed: run this once per worker, with TF_CONFIG set.

Two workers on one host (two terminals, or `&`):

    export TF_CONFIG_CLUSTER='{"worker": ["127.0.0.1:12345", "127.0.0.1:12346"]}'
    TF_CONFIG='{"cluster": '$TF_CONFIG_CLUSTER', "task": {"type": "worker", "index": 0}}' \
        python examples/multiworker.py --out /tmp/mw &
    TF_CONFIG='{"cluster": '$TF_CONFIG_CLUSTER', "task": {"type": "worker", "index": 1}}' \
        python examples/multiworker.py --out /tmp/mw

Each worker reads only its own shard of every pass through kerasfeed's
process executor, trains a small linear model in a custom loop
(`strategy.run` over `kerasfeed.distribute(...)`: Keras 3's `model.fit` does
not work under MultiWorkerMirroredStrategy, keras-team/keras#20585), writes
its own TensorBoard scalars under `--out/logs/worker_<k>`, and the chief
(worker 0) keeps the input position in `--out/data_state.json`. Stop it with
`--stop-after K` and run it again with `--resume` to continue on exactly the
batches an uninterrupted run would have read.

`--out` must be a directory every worker can read and write (a shared
filesystem across hosts); results go to `--out/result_worker_<k>_<phase>.json`.
The `--check-*` flags are used by the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

W_TRUE = np.array([0.5, -1.0, 2.0, 0.25], np.float32)


class LinearSamples:
    """Sample ``i`` is ``(x_i, y_i, i)``; ``y`` is linear in ``x`` plus noise.

    ``calls_path``: every ``__getitem__`` appends its index there (the test
    counts them). It runs in kerasfeed's worker processes.
    """

    def __init__(self, n: int, calls_path: str | None = None):
        self.n = n
        self.calls_path = calls_path

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.calls_path:
            with open(self.calls_path, "a") as f:
                f.write(f"{i}\n")
        rng = np.random.default_rng(int(i))
        x = rng.normal(size=4).astype(np.float32)
        y = np.float32(x @ W_TRUE + 0.5 + 0.01 * rng.normal())
        return x, y, np.int64(i)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory shared by all workers")
    p.add_argument("--items", type=int, default=48, help="samples in the source")
    p.add_argument("--batch-size", type=int, default=8, help="GLOBAL batch size (all workers)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="kerasfeed worker processes per training worker")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (an interruption)")
    p.add_argument("--resume", action="store_true", help="continue from --out/data_state.json and the saved weights")
    p.add_argument("--phase", default="train", help="name of this run in the result file")
    p.add_argument("--check-auto-shard", action="store_true",
                   help="also read one pass of a default to_dataset through experimental_distribute_dataset")
    p.add_argument("--check-errors", action="store_true", help="also check the failures the test expects")
    p.add_argument("--reference", action="store_true", help="first run uninterrupted (phase 'reference')")
    return p.parse_args(argv)


def build_model(strategy, seed):
    import keras

    keras.utils.set_random_seed(seed)  # the same initial weights on every worker
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build(model.trainable_variables)
    return model, optimizer


def make_train_step(strategy, model, optimizer, global_batch):
    import tensorflow as tf

    def step(x, y, i):
        with tf.GradientTape() as tape:
            per_example = tf.square(model(x, training=True)[:, 0] - y)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return tf.reduce_mean(per_example), i

    @tf.function
    def train_step(batch):
        return strategy.run(step, args=batch)

    return train_step


def auto_shard_pass(strategy, args, worker_id):
    """A default ``to_dataset`` (no sharding arguments) read as Keras would:
    through ``strategy.experimental_distribute_dataset``. Returns the steps."""
    import kerasfeed

    calls = os.path.join(args.out, f"calls_auto_worker_{worker_id}.txt")
    ds = kerasfeed.to_dataset(LinearSamples(args.items, calls), batch_size=args.batch_size, shuffle=True,
                              seed=args.seed, executor="processes", workers=args.workers)
    with open(calls, "a") as f:
        f.write("--\n")  # what comes before are the signature probes
    dist = strategy.experimental_distribute_dataset(ds)
    indices = []
    for _x, _y, i in dist:
        indices.append(np.concatenate([t.numpy() for t in strategy.experimental_local_results(i)]).tolist())
    result = {"steps": len(indices), "indices": indices, "cardinality": int(ds.cardinality())}

    # from_generators, created in the strategy's scope: generator shards are
    # split between the workers the same way.
    opened = os.path.join(args.out, f"generators_worker_{worker_id}.txt")

    def make_gen(k):
        with open(opened, "a") as f:
            f.write(f"{k}\n")
        for j in range(4):
            yield np.float32(10 * k + j)

    with strategy.scope():
        gds = kerasfeed.from_generators(make_gen, 6, batch_size=4)
    values = []
    for v in strategy.experimental_distribute_dataset(gds):
        values.append(np.concatenate([t.numpy() for t in strategy.experimental_local_results(v)]).tolist())
    result["generators"] = values

    # An order object fixes its own shards: one per worker, checked to agree.
    labels = np.arange(args.items) % 3
    order = kerasfeed.BalancedOrder(labels, seed=args.seed, num_shards=2, shard_index=worker_id)
    ods = kerasfeed.to_dataset(LinearSamples(args.items), order=order, batch_size=4)
    result["order"] = {"policy": ods.options().experimental_distribute.auto_shard_policy.name,
                       "indices": [int(i) for _x, _y, batch in ods for i in batch.numpy()]}
    return result


def check_errors(strategy, args, worker_id):
    """The failures the test expects, in the same order on every worker."""
    import kerasfeed

    out = {}
    # Workers that disagree on the source length.
    try:
        kerasfeed.to_dataset(LinearSamples(args.items - worker_id), batch_size=4, shuffle=True, seed=args.seed)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    # More workers than items.
    try:
        kerasfeed.to_dataset(LinearSamples(1))
        out["too_few_items"] = None
    except ValueError as e:
        out["too_few_items"] = str(e)
    # model.fit under MultiWorkerMirroredStrategy (Keras 3): fails today.
    model, _ = build_model(strategy, args.seed)
    with strategy.scope():
        model.compile("sgd", "mse")
    ds = kerasfeed.to_dataset(LinearSamples(args.items), batch_size=args.batch_size, shuffle=True, seed=args.seed)
    try:
        model.fit(ds.map(lambda x, y, i: (x, y)), epochs=1, verbose=0, shuffle=False)
        out["fit"] = "ok"
    except Exception as e:  # noqa: BLE001 - recorded for the test
        out["fit"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def check_alone(strategy, args, worker_id):
    """A sharded dataset that only worker 0 creates fails there after the
    (shortened) agreement timeout instead of hanging; the cluster's collective
    ops stay usable afterwards (the check waits in the coordination service's
    key-value store, not in a collective that would have to be aborted), so
    both workers then sum a value across the cluster, as a training step would."""
    import time

    import tensorflow as tf

    import kerasfeed
    from kerasfeed.loading import agreement

    done = os.path.join(args.out, "alone_worker_0.txt")
    if worker_id == 0:
        agreement.AGREEMENT_TIMEOUT_S = 5.0
        try:
            kerasfeed.to_dataset(LinearSamples(args.items), shuffle=True, seed=args.seed)
            message = "created"
        except RuntimeError as e:
            message = str(e)
        with open(done + ".tmp", "w") as f:
            f.write(message)
        os.replace(done + ".tmp", done)
    else:
        deadline = time.monotonic() + 120
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.2)

    @tf.function
    def total():
        ones = strategy.run(lambda: tf.constant(worker_id + 1.0))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, ones, axis=None)

    return float(total().numpy())


def train(strategy, args, worker_id, phase, stop_after=None, resume=False):
    """One training run (custom loop); returns what the test checks."""
    import keras

    import kerasfeed

    chief = worker_id == 0
    state_path = os.path.join(args.out, "data_state.json")
    weights_path = os.path.join(args.out, "weights_worker_0.npz")
    model, optimizer = build_model(strategy, args.seed)
    state = None
    if resume:
        state = kerasfeed.TrainingProgress.load(state_path)  # written by the chief
        saved = np.load(weights_path)
        model.set_weights([saved[f"w{k}"] for k in range(len(saved.files))])
    train_step = make_train_step(strategy, model, optimizer, args.batch_size)

    calls = os.path.join(args.out, f"calls_{phase}_worker_{worker_id}.txt")
    dist = kerasfeed.distribute(strategy, LinearSamples(args.items, calls), batch_size=args.batch_size,
                                shuffle=True, seed=args.seed, executor="processes", workers=args.workers,
                                initial_state=state)
    progress = kerasfeed.TrainingProgress(state, path=state_path if chief else None)
    summaries = kerasfeed.WorkerSummaries(os.path.join(args.out, "logs", phase))
    callbacks = keras.callbacks.CallbackList([progress, summaries], model=model)

    model.stop_training = False  # as model.fit sets it; TrainingProgress reads it at epoch end
    start = state["epoch"] if state else 0
    steps, losses, stopped = [], [], False
    callbacks.on_train_begin()
    for epoch in range(start, args.epochs):
        callbacks.on_epoch_begin(epoch)
        epoch_losses = []
        for step, batch in enumerate(dist):  # a resumed first pass starts mid-way
            shard_loss, idx = train_step(batch)
            # This worker's loss on its own shard (its replicas' mean).
            epoch_losses.append(float(np.mean([float(v) for v in strategy.experimental_local_results(shard_loss)])))
            steps.append({"epoch": epoch, "indices": np.concatenate(
                [t.numpy() for t in strategy.experimental_local_results(idx)]).tolist()})
            callbacks.on_train_batch_end(step, {"loss": epoch_losses[-1]})
            if stop_after is not None and len(steps) == stop_after:
                stopped = True
                break
        if stopped:
            break
        losses.append(float(np.mean(epoch_losses)))
        callbacks.on_epoch_end(epoch, {"loss": losses[-1]})
    callbacks.on_train_end()

    weights = model.get_weights()
    if chief and stopped:
        np.savez(weights_path, **{f"w{k}": w for k, w in enumerate(weights)})
    return dict(steps=steps, losses=losses, stopped=stopped, state=progress.state(),
                weights=[w.ravel().tolist() for w in weights], run_dir=summaries.run_dir)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    import tensorflow as tf

    # Before any other TensorFlow op: it joins the cluster described by TF_CONFIG.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    resolver = strategy.cluster_resolver
    worker_id = resolver.task_id if resolver.task_type == "worker" else 0
    results = {}
    if args.check_auto_shard:
        results["auto"] = auto_shard_pass(strategy, args, worker_id)
    if args.reference:  # an uninterrupted run first, to compare a resumed one with
        results["reference"] = train(strategy, args, worker_id, "reference")
    results[args.phase] = train(strategy, args, worker_id, args.phase, args.stop_after, args.resume)
    if args.check_errors:
        results["errors"] = check_errors(strategy, args, worker_id)
        results["sum_after_failed_agreement"] = check_alone(strategy, args, worker_id)
    results.update(worker=worker_id, replicas=strategy.num_replicas_in_sync)
    with open(os.path.join(args.out, f"result_worker_{worker_id}_{args.phase}.json"), "w") as f:
        json.dump(results, f)
    run = results[args.phase]
    print(f"worker {worker_id}: {len(run['steps'])} steps, epoch losses {run['losses']}, "
          f"summaries in {run['run_dir']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
