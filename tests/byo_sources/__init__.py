"""Users' own Keras ``Sequence`` classes, one import style per module (tests/processes/test_byo_sequence.py).

Real module files: a worker process imports them when it unpickles a source
(classes pickled by reference), with kerasfeed's light Keras/TensorFlow
stand-ins in place. Each item carries ``flags``: which frameworks the process
that made it has in ``sys.modules`` (see ``_flags``).
"""
