"""``load_export`` (a TFRecord export as a pure-TensorFlow dataset) and ``verify_export``."""

from __future__ import annotations

import glob
import os
from typing import Any, Optional

from kerasfeed import _validation as _v
from kerasfeed._nest import pack
from kerasfeed.exporting.arrayrecord import check_verify, raise_bad
from kerasfeed.exporting.manifest import ExportError, bad_shards, read_manifest
from kerasfeed.exporting.spec import STRING, ExportSpec

AUTOTUNE = _v.AUTOTUNE
_TF_COMPRESSION = {None: "", "GZIP": "GZIP", "ZLIB": "ZLIB"}
_PARSE_GROUP = 32
# Stands in for the records a damaged shard could not give. Every record
# kerasfeed writes is a serialized tf.train.Example, whose first byte is
# b"\n" (field 1), so no record starts with this.
_DAMAGED = "kerasfeed: damaged shard "


def verify_export(directory: Any) -> dict:
    """Checks that an export is complete and every shard is intact.

    Every shard file must exist and match its manifest entry: byte size and
    CRC32C of the whole file (so every byte is read once), and an item count
    that fits the layout; the counts must add up to the number of items.

    Args:
        directory: the export directory.

    Returns:
        ``{"items": n, "shards": s, "bytes": total}``.

    Raises:
        kerasfeed.ExportError: the export is incomplete, or names every shard
            file that is missing, truncated or changed, and what is wrong.

    Example:

    ```python
    kerasfeed.verify_export("/tmp/squares")   # {'items': 10, 'shards': 2, 'bytes': ...}
    ```
    """
    directory, manifest = read_manifest(_v.path("directory", directory, owner="verify_export"))
    # Every shard's count is checked against the layout, whose counts add up to num_items.
    raise_bad(directory, bad_shards(directory, manifest, checksum=True))
    shards = manifest["shards"]
    return {"items": sum(s["count"] for s in shards), "shards": len(shards), "bytes": sum(s["bytes"] for s in shards)}


def load_export(
    directory: Any,
    *,
    shuffle_files: bool = False,
    seed: Optional[int] = None,
    num_shards: int = 1,
    shard_index: int = 0,
    input_context: Any = None,
    num_parallel_reads: int = AUTOTUNE,
    verify: Any = "size",
):
    """A TFRecord export as a ``tf.data.Dataset`` of its items, with no Python per element.

    The shard files are read in parallel (an interleave of
    ``TFRecordDataset``s) and the records parsed with ``tf.io.parse_example``
    and ``tf.io.decode_raw``: pure TensorFlow ops, so the pipeline runs at
    tf.data speed, can be checkpointed, and can run on the tf.data service.
    The element spec is ``to_dataset(source).element_spec`` (the source's,
    with the leading batch dimension of every array left open, as
    ``to_dataset`` leaves it for items that are batches); the cardinality is
    known.

    Order: with ``shuffle_files=False`` items come in index order (item
    ``i`` of the source is element ``i``, as in ``to_dataset``'s first pass):
    the interleave cycles over all the files read, one record at a time.
    ``shuffle_files=True`` draws a new file order every pass (seeded) and
    mixes at most 16 files at a time; add ``.shuffle(buffer)`` for
    per-item randomness.

    Damage: ``verify="size"`` (the default) checks up front that every shard
    exists with the size in the manifest (cheap; catches truncated, missing
    and replaced files, naming them); ``verify="checksum"`` also reads every
    file once and checks its CRC32C. Bytes that change later, or inside a
    file of the right size, are caught while reading by TFRecord's own
    per-record CRC, at no extra cost: iterating raises
    ``tf.errors.InvalidArgumentError`` ("kerasfeed: damaged shard
    shard-00001-of-00008.tfrecord: ... Received: file=...") within 32
    elements of where the first damaged record would have come (records are
    checked 32 at a time; every element before the error is intact);
    ``verify_export`` then lists every damaged shard.

    Args:
        directory: an export written by ``kerasfeed.export`` (TFRecord).
        shuffle_files: read the shard files in a new seeded order every pass.
        seed: seed of the file order.
        num_shards: split the files between this many input pipelines
            (training workers); it must divide the number of files (a
            ValueError says how many items an uneven split would leave out).
            This one reads files ``shard_index``, ``shard_index +
            num_shards``, ... and yields ``len // num_shards`` items, exactly
            those ``to_dataset(..., num_shards=...)`` gives.
        shard_index: the pipeline this dataset is.
        input_context: a ``tf.distribute.InputContext``; sets the two above.
        num_parallel_reads: files read at once (``tf.data.AUTOTUNE``: tf.data
            decides).
        verify: ``"size"``, ``"checksum"`` or ``False`` (see above).

    Returns:
        A ``tf.data.Dataset``.

    Raises:
        kerasfeed.ExportError: not a complete TFRecord export, or a shard is
            missing or damaged (named).
        ValueError: bad arguments, or ``num_shards`` does not divide the
            number of files.

    Example:

    ```python
    ds = kerasfeed.load_export("/tmp/squares")           # written by kerasfeed.export
    model.fit(ds.padded_batch(4), epochs=3, shuffle=False)  # assumes a `model`
    ```
    """
    import tensorflow as tf

    from kerasfeed.tfdata.functions import graph_fn

    directory, manifest = read_manifest(_v.path("directory", directory, owner="load_export"))
    if manifest["file_format"] != "tfrecord":
        raise ExportError(
            f"load_export reads TFRecord exports; '{directory}' holds {manifest['file_format']} files: read it with "
            "kerasfeed.to_dataset(kerasfeed.ExportSource(directory)). "
            f"Received: file_format={manifest['file_format']!r}"
        )
    _v.flag("shuffle_files", shuffle_files, owner="load_export")
    seed = _v.seed("seed", seed, owner="load_export")
    if seed is not None and not shuffle_files:
        raise ValueError("load_export: `seed` orders the shard files, which only shuffle_files=True shuffles: pass "
                         f"shuffle_files=True, or no seed. Received: seed={seed}, shuffle_files=False")
    reads = _v.positive_int("num_parallel_reads", num_parallel_reads, allow_autotune=True, owner="load_export")
    check_verify(verify)
    if input_context is not None:
        if num_shards != 1 or shard_index != 0:
            raise ValueError(
                "load_export: pass either `input_context` or `num_shards`/`shard_index`, not both. "
                f"Received: num_shards={num_shards}, shard_index={shard_index}, input_context={input_context}"
            )
        num_shards, shard_index = input_context.num_input_pipelines, input_context.input_pipeline_id
    files_total = manifest["num_shards"]
    num_shards = _v.positive_int("num_shards", num_shards, owner="load_export")
    if num_shards > files_total:
        given = ("num_shards" if input_context is None else "input_context.num_input_pipelines") + f"={num_shards}"
        raise ValueError(
            f"load_export: the export has {files_total} files, fewer than the input pipelines: every input pipeline "
            f"needs at least one; export with more shards. Received: {given}"
        )
    shard_index = _v.non_negative_int("shard_index", shard_index, owner="load_export")
    if shard_index >= num_shards:
        raise ValueError(
            f"load_export: `shard_index` must be in [0, {num_shards}). Received: shard_index={shard_index}"
        )
    shards = manifest["shards"]
    _check_even_split(shards, num_shards, manifest["num_items"], from_context=input_context is not None)
    if verify:
        raise_bad(directory, bad_shards(directory, manifest, checksum=verify == "checksum"))

    mine = [s for k, s in enumerate(shards) if k % num_shards == shard_index]
    # With the files split evenly this is len // num_shards: fewer than num_shards items (those
    # past the last full round) are left out, as to_dataset leaves them out.
    count = min(sum(s["count"] for s in shards[w::num_shards]) for w in range(num_shards))
    files = [os.fspath(directory / s["file"]) for s in mine]
    spec = ExportSpec.from_json(manifest["element_spec"])
    compression = _TF_COMPRESSION[manifest["compression"]]
    buffer_size = max(64 << 10, min(1 << 20, (32 << 20) // len(files)))

    counts = [s["count"] for s in mine]
    notes = [_damage_note(directory, s, str(f)) for s, f in zip(mine, files)]

    def read(file, pattern, count, note):
        # TFRecordDataset checks each record's CRC32C but its DataLossError names no file. A
        # failing record (or read) ends this shard's reader quietly instead, and the records it
        # could not give are replaced by the shard's note, which the parse step below raises:
        # the error names the file, in the group of 32 that holds the first bad record.
        # A file that is gone is not read at all: its reader fails at every call without moving on, and
        # ignore_errors() would call it again for ever (a hang at 100 % CPU); its shard's note names it.
        there = tf.size(tf.io.matching_files(pattern)) > 0
        records = tf.data.TFRecordDataset(file, compression_type=compression, buffer_size=buffer_size)
        records = records.take(tf.where(there, tf.constant(-1, tf.int64), tf.constant(0, tf.int64)))
        filler = tf.data.Dataset.from_tensors(note).repeat()
        return records.ignore_errors().concatenate(filler).take(count)

    # Each file's path as a glob pattern that matches only itself: TensorFlow's matcher also takes a backslash
    # as an escape, which glob.escape leaves alone on POSIX (a healthy export read as damaged).
    patterns = [glob.escape(f).replace("\\", "\\\\") for f in files]
    ds = tf.data.Dataset.from_tensor_slices((files, patterns, tf.constant(counts, tf.int64), notes))
    cycle = len(files)
    if shuffle_files:
        ds = ds.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)
        cycle = min(cycle, 16)
    parallel = AUTOTUNE if reads == AUTOTUNE else min(reads, cycle)
    ds = ds.interleave(
        graph_fn(read), cycle_length=cycle, block_length=1, num_parallel_calls=parallel, deterministic=True
    )
    if count < sum(counts):
        ds = ds.take(count)  # every pipeline takes the same number of steps
    # Records are parsed in groups (one vectorized ParseExample per group costs far
    # less than one per record), then each item's arrays are decoded and shaped.
    parse, decode = (graph_fn(f) for f in make_parser(spec))  # no AutoGraph temp files
    ds = ds.batch(_PARSE_GROUP).map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()
    ds = ds.map(decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.apply(tf.data.experimental.assert_cardinality(count))


def _check_even_split(shards: list, num_shards: int, num_items: int, from_context: bool) -> None:
    """Refuses a ``num_shards`` that does not divide the number of files.

    A pipeline reads whole files: a TFRecord file has no index, so taking part of one means
    reading all of it. With a file count that ``num_shards`` does not divide, the shares differ
    by whole files, and cutting every pipeline to the smallest would drop them in silence.
    """
    files = len(shards)
    if files % num_shards == 0:
        return
    shares = [sum(s["count"] for s in shards[w::num_shards]) for w in range(num_shards)]
    lost = num_items - num_shards * min(shares)
    divisors = [d for d in range(1, files + 1) if files % d == 0]
    given = "input_context.num_input_pipelines" if from_context else "num_shards"
    raise ValueError(
        f"load_export: {num_shards} input pipelines cannot share the export's {files} files evenly (each reads "
        f"whole files): their shares would be {shares} items, and with every pipeline taking the same number of "
        f"steps {lost} of the {num_items} items would never be read. Export with a number of shards divisible by "
        f"{num_shards} (e.g. num_shards={num_shards * -(-files // num_shards)}), or read with a "
        f"`num_shards` that divides {files} ({', '.join(map(str, divisors))}). Received: {given}={num_shards}"
    )


def _damage_note(directory: Any, entry: dict, path: str) -> str:
    # No quotes: TensorFlow escapes them when it prints the assertion's data.
    return (
        f"{_DAMAGED}{entry['file']}: one of its {entry['count']} records failed its TFRecord checksum (or the file "
        f"could not be read), so the file changed after the export. kerasfeed.verify_export(directory) checks "
        f"every shard of {directory}; kerasfeed.export(..., resume=True) rewrites the damaged ones. "
        f"Received: file={path}"
    )


def make_parser(spec: ExportSpec):
    """Two TensorFlow functions: a batch of serialized records -> their features,
    and one record's features -> the item's nest of tensors."""
    import tensorflow as tf

    features = {}
    for key, dtype, shape in zip(spec.keys, spec.dtypes, spec.shapes):
        features[key] = tf.io.RaggedFeature(tf.string) if dtype == STRING else tf.io.FixedLenFeature([], tf.string)
        if shape:
            features[key + ":shape"] = tf.io.FixedLenFeature([len(shape)], tf.int64)

    def parse(records):
        damaged = tf.strings.substr(records, 0, len(_DAMAGED)) == _DAMAGED
        first = tf.argmax(tf.cast(damaged, tf.int32))
        check = tf.debugging.Assert(tf.logical_not(tf.reduce_any(damaged)), [records[first]])
        with tf.control_dependencies([check]):
            return tf.io.parse_example(records, features)

    def decode(parsed):
        leaves = []
        for key, dtype, shape in zip(spec.keys, spec.dtypes, spec.shapes):
            if dtype == STRING:
                value = parsed[key]
            elif dtype in ("uint32", "uint64"):  # decode_raw has no unsigned 32/64-bit types
                raw = tf.io.decode_raw(parsed[key], tf.int32 if dtype == "uint32" else tf.int64)
                value = tf.bitcast(raw, tf.as_dtype(dtype))
            else:
                value = tf.io.decode_raw(parsed[key], tf.as_dtype(dtype))
            value = tf.reshape(value, parsed[key + ":shape"] if shape else [])
            # NOTE [ Open leading dimension ]: to_dataset(source) leaves the first dimension of
            # every array open (items may be batches of any size, as under Keras); load_export gives
            # the same element spec, so one can stand in for the other. The stored spec keeps the
            # exact shape: it checks what is written.
            value.set_shape([None, *shape[1:]] if shape else shape)
            leaves.append(value)
        return pack(spec.skeleton, leaves)

    return parse, decode
