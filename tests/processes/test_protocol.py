"""The parent/worker message types: wire form, field names, and decoding errors.

No process is started: these run on the types alone.
"""

from __future__ import annotations

import pickle

import pytest

from kerasfeed.errors import ItemError
from kerasfeed.execution.processes import protocol

# One example of every message that travels on the wire, with the tuple it
# has always been sent as (the bytes on the wire do not change).
WIRE = [
    (protocol.Init({"worker_id": 0}), ("init", {"worker_id": 0})),
    (protocol.Load(7, 42, 3, 1), ("load", 7, 42, 3, 1)),
    (protocol.SetState(2, b"state"), ("state", 2, b"state", {})),
    (protocol.StartStream(8, b"task", [0, 1], "gen(3)", {"tok": {"password": "p"}}),
     ("stream", 8, b"task", [0, 1], "gen(3)", {"tok": {"password": "p"}})),
    (protocol.Credit(8, 1), ("credit", 8, 1)),
    (protocol.Cancel(8), ("cancel", 8)),
    (protocol.Exit(), ("exit",)),
    (protocol.Ready({"pid": 12}), ("ready", {"pid": 12})),
    (protocol.InitError("ValueError", "bad", "Traceback..."), ("init_error", "ValueError", "bad", "Traceback...")),
    (protocol.ItemDone(7, 1, b"spec", 8192, 4000, 0.25, 0.5), ("item", 7, 1, b"spec", 8192, 4000, 0.25, 0.5)),
    (
        protocol.ItemFailed(7, ItemError.from_exception(3, ValueError("boom"), worker_id=0, pid=1, source_name="src")),
        None,
    ),
    (protocol.StreamItem(8, 0, 1, b"spec", None, 0.25, 0.5), ("stream_item", 8, 0, 1, b"spec", None, 0.25, 0.5)),
    (protocol.StreamStarted(8), ("stream_started", 8)),
    (protocol.StreamEnd(8, 5), ("stream_end", 8, 5)),
    (
        protocol.StreamFailed(
            8, ItemError.from_exception(3, ValueError("boom"), worker_id=0, pid=1, source_name="src")
        ),
        None,
    ),
]


@pytest.mark.parametrize("message, wire", WIRE, ids=[type(m).__name__ for m, _ in WIRE])
def test_each_message_encodes_to_its_tuple_and_decodes_back(message, wire):
    raw = protocol.encode(message)
    assert type(raw) is tuple and raw[0] == message.kind
    if wire is not None:
        assert raw == wire
    # Through pickle, as the channel sends it: the same type and fields come back.
    back = protocol.decode(pickle.loads(pickle.dumps(raw, protocol=5)))
    assert type(back) is type(message)
    if wire is not None:
        assert back == message
    else:
        assert back[0] == message[0] and str(back.error) == str(message.error)


def test_fields_are_read_by_name():
    msg = protocol.decode(("item", 3, 2, b"s", None, 10, 0.25, 0.5))
    assert (msg.request_id, msg.slot, msg.spec, msg.new_size, msg.nbytes) == (3, 2, b"s", None, 10)
    assert (msg.make_s, msg.write_s) == (0.25, 0.5)  # the worker's own timing (kerasfeed.stats)
    msg = protocol.decode(("stream_item", 4, 9, 0, b"s", 4096, 0.125, 0.0625))
    assert (msg.stream_id, msg.n, msg.slot, msg.new_size) == (4, 9, 0, 4096)
    assert (msg.make_s, msg.write_s) == (0.125, 0.0625)  # the worker's own timing (kerasfeed.stats)


def test_kinds_are_unique_and_every_type_documents_its_direction():
    types = [type(m) for m, _ in WIRE] + [protocol.WorkerDied]
    assert len({t.kind for t in types}) == len(types)
    for t in types:
        assert "->" in t.__doc__, t


def test_worker_died_is_consumer_only():
    err = RuntimeError("gone")
    died = protocol.WorkerDied(err)
    assert died.error is err
    with pytest.raises(ValueError, match="unknown worker message"):
        protocol.decode(protocol.encode(died))


@pytest.mark.parametrize(
    "raw, match",
    [
        (("nope", 1), "unknown worker message"),
        ((), "unknown worker message"),
        (("load", 1, 2), r"'load' needs 4 fields .*Received: 2"),
    ],
)
def test_a_malformed_message_is_refused_with_what_was_received(raw, match):
    with pytest.raises(ValueError, match=match):
        protocol.decode(raw)
