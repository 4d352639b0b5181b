"""HDF5 sources: contiguous row slices, time windows, and PointNet-style block sampling.

Public classes (each in a module of its own):

- ``H5SliceSequence``: batch ``i`` is a contiguous slice of rows (axis 0) of one or more HDF5 datasets;
  several files form one index space.
- ``H5WindowSequence``: each sample is a window of ``window`` consecutive rows (time steps) of a dataset;
  windows start every ``stride`` rows.
- ``H5RowSequence``: batches of the rows an order (balanced, weighted...) picks.
- ``ScenePointSampler``: a ``transform`` for ``H5SliceSequence`` that cuts each scene into blocks on the
  ground plane and samples a fixed number of points per block (PointNet's training recipe), with
  per-point labels.

How files are opened (why it matters: docs/field_notes.md, *h5py lock*):
  h5py serialises every call in a process behind one lock, and its handles must not cross a fork or
  pickling. So the sequences open their files lazily, in the process that reads, on its first read
  there, and remember that process id: a pickled copy has no handles and reopens on its first read; a
  forked child sees another pid and opens its own, leaving the inherited ones untouched. The
  constructor opens each file briefly to check keys and shapes, and closes it. Within a process,
  sequences reading the same file share one handle per file and dataset (``handles.FileRegistry``
  says why); ``close()``, a ``with`` block or garbage collection releases it, the file closes when no
  sequence of the process uses it, and a later read reopens it. A sequence keeps at most ``max_open_files``
  files open (a quarter of ``RLIMIT_NOFILE`` by default) and closes the least recently read past it
  (``held.py``). As h5py's lock serialises threads,
  parallel reads come from worker processes (``to_dataset(seq, executor="processes")`` or
  ``model.fit`` with ``use_multiprocessing=True``), not threads.

Files that grow while training (SWMR):
  Every dataset's length is a snapshot taken at construction: ``len(seq)`` is fixed, as Keras and
  tf.data require within an epoch, and rows appended later are not read. To read a file another
  process appends to, the writer must use HDF5's single-writer/multiple-reader mode
  (``h5py.File(..., "a", libver="latest")``, then ``f.swmr_mode = True``, and ``flush()`` after
  appending) and the reader must pass ``swmr=True`` (files opened with ``swmr=True``): the snapshot's
  rows then read correctly while the writer appends (with several keys, the rows every key has: a
  writer appending to one after the other is seen a row apart). Without SWMR, HDF5 guarantees nothing: opening
  fails while a writer holds the file ("file is already open for write" or "unable to lock file"), and
  a file changed under an open reader may read inconsistent metadata. To train on the new rows, build a
  new sequence (cheap: it only reads shapes), e.g. once per epoch; in one process both share handles,
  which HDF5 needs to read appended chunks correctly.

Files replaced or shortened after construction:
  A file is known by its inode, not only its path. A writer that writes a new file and renames it over
  the old one (``make_synthetic_scenes`` does) makes a new file, which a sequence built afterwards reads
  even while older sequences hold the old one open. An older sequence keeps reading the file it
  inspected while its process has that file open; where it would have to reopen the path (after
  ``close()``, in a worker process) it raises ``FileChangedError`` (an ``OSError``) rather than read
  another file as if it had the old length. A read that finds fewer rows than the sequence saw (a
  dataset resized or the file rewritten in place) raises the same error, naming the file, key and rows;
  so does any read after the file was written in place (its size or modification time changed, with
  the same inode: ``cp`` or ``shutil.copyfile`` over it, ``rsync --inplace``, an HDF5 writer with
  locking off), checked after each read without ``swmr``: HDF5 reads an open file by the layout it
  cached, and such a file reads back zeros or other bytes, silently, through h5py itself. After
  changing a file, build a new sequence. Links and virtual datasets are followed as h5py follows
  them; a link whose target is missing, or a virtual dataset whose source file is not there (HDF5
  would read its fill value), is refused at construction, naming it.

Files in object stores (docs/remote.md):
  Any path may be an ``s3://``, ``gs://`` or ``http(s)://`` URL, with ``storage_options=`` for fsspec
  (``pip install kerasfeed[remote]``). The object's version is pinned at construction and its chunk
  layout read once; a batch's chunks are then fetched as byte ranges, all at once, and decoded outside
  h5py (``remote/chunks.py`` says which layouts and filters are, and which h5py reads instead). An
  object replaced during the run raises ``FileChangedError``; credentials in ``storage_options`` are
  never pickled (``remote/urls.py``).

Modules: ``slices.py``, ``windows.py``, ``rows.py`` (one sequence each), ``base.py`` (what they share),
``local_files.py`` (its base ``LocalFiles``: local files held per process, refused once replaced),
``inspection.py`` (a file's keys checked at construction), ``handles.py`` (the per-process handle
registry), ``keys.py`` (paths and keys), ``options.py`` (the shared keyword arguments), ``remote/``
(URLs). ``ScenePointSampler`` lives in ``kerasfeed/transforms.py``.
"""

from kerasfeed.hdf5.base import FileChangedError
from kerasfeed.hdf5.rows import H5RowSequence
from kerasfeed.hdf5.slices import H5SliceSequence
from kerasfeed.hdf5.windows import H5WindowSequence
from kerasfeed.remote.options import RemoteOptions
from kerasfeed.transforms import ScenePointSampler

__all__ = ["H5SliceSequence", "H5WindowSequence", "H5RowSequence", "ScenePointSampler", "FileChangedError",
           "RemoteOptions"]
