"""Multi-host `model.fit` on JAX with kerasfeed: run this once per process.

Keras' distribution API (`keras.distribution.initialize` + `DataParallel`)
runs one process per host; `kerasfeed.to_loader` then reads only this
process's shard of every pass by itself, and each process's batch becomes its
part of the global batch. Two processes on one host (CPU, gloo collectives):

    export KERAS_DISTRIBUTION_JOB_ADDRESSES=127.0.0.1:12345 KERAS_DISTRIBUTION_NUM_PROCESSES=2
    KERAS_DISTRIBUTION_PROCESS_ID=0 python examples/multihost_jax.py --out /tmp/mh &
    KERAS_DISTRIBUTION_PROCESS_ID=1 python examples/multihost_jax.py --out /tmp/mh

On several hosts, the same three variables on every host (the coordinator is
process 0's `host:port`), each host with its own process id. The run trains a
linear model with `model.fit`, process 0 keeps the input position in
`--out/data_state.json`; `--phases stop --stop-after K` interrupts it after K
steps and a second run with `--phases resume` continues on exactly the batches
an uninterrupted run would have read. Results go to `--out/result_<k>_<phase>.json`; the
`--phases` and `--check-errors` flags are used by tests/test_multihost.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

W_TRUE = np.array([0.5, -1.0, 2.0, 0.25], np.float32)
LR = 0.05


def sample(i: int) -> tuple:
    """Sample ``i``: ``x`` (4,) and ``y`` (1,), linear in ``x`` plus noise."""
    rng = np.random.default_rng(int(i))
    x = rng.normal(size=4).astype(np.float32)
    return x, np.array([x @ W_TRUE + 0.5 + 0.01 * rng.normal()], np.float32)


class LinearSamples:
    """An indexable source (any object with ``__len__``/``__getitem__``).

    ``calls_path``: every ``__getitem__`` appends its index there (the test
    counts them); it runs in kerasfeed's worker processes.
    """

    def __init__(self, n: int, calls_path: str | None = None):
        self.n, self.calls_path = n, calls_path

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.calls_path:
            with open(self.calls_path, "a") as f:
                f.write(f"{i}\n")
        return sample(i)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory every process can read and write")
    p.add_argument("--items", type=int, default=64, help="samples in the source")
    p.add_argument("--batch-size", type=int, default=4, help="PER-PROCESS batch (global: x processes)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="kerasfeed worker processes per process")
    p.add_argument("--stop-after", type=int, default=None, help="phase 'stop': stop after this many steps")
    p.add_argument("--phases", default="train",
                   help="comma-separated: 'train'/'full' (from scratch), 'stop' (then stopped), 'resume'")
    p.add_argument("--check-errors", action="store_true", help="also check the failures the test expects")
    return p.parse_args(argv)


class StepLog:
    """Counts the steps of every epoch; stops fit after ``stop_after`` steps."""

    def __init__(self, stop_after=None):
        import keras

        class _Callback(keras.callbacks.Callback):
            def on_epoch_begin(cb, epoch, logs=None):
                self.steps.append(0)

            def on_train_batch_end(cb, batch, logs=None):
                self.steps[-1] += 1
                if stop_after is not None and sum(self.steps) == stop_after:
                    cb.model.stop_training = True

        self.steps: list = []
        self.callback = _Callback()


def build_model():
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    model.compile(keras.optimizers.SGD(LR), "mse")
    return model


def train(args, k: int, phase: str) -> dict:
    """One ``model.fit`` run of this process; returns what the test checks."""
    import kerasfeed
    from kerasfeed.integrations.input_stats import input_run_dir

    state_path = os.path.join(args.out, "data_state.json")
    weights_path = os.path.join(args.out, f"weights_{k}.npz")
    calls = os.path.join(args.out, f"calls_{phase}_{k}.txt")
    model = build_model()
    state = {"epoch": 0, "batches": 0}
    if phase == "resume":
        state = kerasfeed.TrainingProgress.load(state_path)  # written by process 0
        saved = np.load(weights_path)
        model.set_weights([saved[f"w{j}"] for j in range(len(saved.files))])
    log = StepLog(args.stop_after if phase == "stop" else None)
    history, epoch, stats, progress_state = {"loss": []}, state["epoch"], None, state

    def fit(initial_state, epochs):
        nonlocal stats, progress_state
        # batch_size is this process's batch; to_loader reads this process's shard by itself.
        with kerasfeed.to_loader(LinearSamples(args.items, calls), batch_size=args.batch_size, shuffle=True,
                                 seed=args.seed, executor="processes", workers=args.workers,
                                 initial_state=initial_state) as loader:
            # Process 0 writes the state; every process resumes from it. order=loader: the state holds the
            # order as this run splits it (a shard per process), so a resume on another number of processes
            # is refused instead of skipping or repeating items.
            progress = kerasfeed.TrainingProgress(progress_state, order=loader,
                                                  path=state_path if k == 0 and phase != "full" else None)
            with open(calls, "a") as f:
                f.write("--\n")  # the signature probes come before
            h = model.fit(loader, initial_epoch=epoch, epochs=epochs, verbose=0,
                          callbacks=[progress, log.callback])
            stats = kerasfeed.stats(loader)
            progress_state = progress.state()
        history["loss"] += h.history.get("loss", [])

    if state["batches"]:  # finish the interrupted epoch in a fit call of its own
        fit(state, epoch + 1)
        epoch += 1
    if epoch < args.epochs:
        fit({"epoch": epoch, "batches": 0}, args.epochs)
    weights = model.get_weights()
    if phase == "stop":
        np.savez(weights_path, **{f"w{j}": w for j, w in enumerate(weights)})
    return dict(loss=history["loss"], steps=log.steps, state=progress_state,
                weights=[w.ravel().tolist() for w in weights], stats_process=stats["process"],
                input_run_dir=input_run_dir("logs"), worker_run_dir=kerasfeed.worker_run_dir("logs"))


def check_errors(args, k: int) -> dict:
    """The failures the test expects, in the same order on every process."""
    import kerasfeed

    out = {}
    cases = {
        "mismatch": dict(source=LinearSamples(args.items - k), batch_size=args.batch_size, drop_remainder=True),
        "peer_failed": dict(source=LinearSamples(args.items), batch_size=args.batch_size if k == 0 else 0),
        "indivisible": dict(source=LinearSamples(args.items), batch_size=3),  # 2 local devices each
        "no_seed": dict(source=LinearSamples(args.items), batch_size=args.batch_size, seed=None),
    }
    for name, kwargs in cases.items():
        kwargs = {"shuffle": True, "seed": args.seed, **kwargs}
        try:
            kerasfeed.to_loader(kwargs.pop("source"), **kwargs).close()
            out[name] = None
        except (ValueError, RuntimeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def check_meshes(args, k: int) -> dict:
    """Which shard a loader reads under two ``ModelParallel`` meshes of the four
    devices (no training): ``{mesh: {"shards": ..., "x0": first feature of every
    sample of pass 0}}``."""
    import keras

    import kerasfeed
    from kerasfeed.loading.hosts import current_processes

    devices = np.array(keras.distribution.list_devices()).reshape(2, 2)  # row p: process p's two devices
    out = {}
    for name, axes in {"batch_rows": ["batch", "model"], "batch_columns": ["model", "batch"]}.items():
        mesh = keras.distribution.DeviceMesh((2, 2), axes, devices)
        dist = keras.distribution.ModelParallel(layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch")
        with dist.scope():
            p = current_processes()
            with kerasfeed.to_loader(LinearSamples(16), batch_size=2, shuffle=True, seed=args.seed) as loader:
                x0 = [float(v) for x, _ in loader for v in x[:, 0]]
        out[name] = {"shards": [p.num_shards, p.shard_index, p.local_batch_shards], "x0": x0}
    return out


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import jax

    # Collectives between CPU processes (GPUs and TPUs bring their own).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import keras

    # Reads KERAS_DISTRIBUTION_JOB_ADDRESSES / _NUM_PROCESSES / _PROCESS_ID.
    keras.distribution.initialize()
    k = jax.process_index()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=keras.distribution.list_devices()))
    results = {"process": k, "processes": jax.process_count(), "devices": jax.device_count(),
               "local_devices": jax.local_device_count()}
    for phase in args.phases.split(","):
        results[phase] = train(args, k, phase)
        print(f"process {k} {phase}: steps {results[phase]['steps']}, losses {results[phase]['loss']}", flush=True)
    if args.check_errors:
        results["errors"] = check_errors(args, k)
        results["meshes"] = check_meshes(args, k)
    with open(os.path.join(args.out, f"result_{k}_{args.phases.replace(',', '_')}.json"), "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
