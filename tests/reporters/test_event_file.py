"""reporters/event_file.py: TensorBoard's record framing without TensorBoard's writer."""
from __future__ import annotations

import struct

from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary

from tndebug.reporters.event_file import EventFile, crc32c, masked_crc32c


def test_crc32c_is_castagnoli():
    assert crc32c(b"123456789") == 0xE3069283           # the standard check value (RFC 3720)
    assert crc32c(b"") == 0


def test_records_are_framed_and_tensorboard_reads_them(tmp_path):
    f = EventFile(tmp_path)
    f.add_event(Event(file_version="brain.Event:2"))
    for step in range(3):
        f.add_event(Event(summary=Summary(value=[Summary.Value(tag="x", simple_value=step / 2)])),
                    step=step, walltime=100.0 + step)
    f.close()
    data = f.path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert struct.unpack("<I", data[8:12])[0] == masked_crc32c(data[:8])
    assert struct.unpack("<I", data[12 + n:16 + n])[0] == masked_crc32c(data[12:12 + n])
    assert f.path.name.startswith("events.out.tfevents.")
    acc = ea.EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value, e.wall_time) for e in acc.Scalars("x")] == \
        [(0, 0.0, 100.0), (1, 0.5, 101.0), (2, 1.0, 102.0)]
