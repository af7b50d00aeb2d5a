"""Sophgo bmodel files: the build-time string that keeps two builds from being identical."""

import os
import re
import struct
import time
from pathlib import Path

from npuforge.errors import NpuforgeError

# The bmodel's build time: a flatbuffers string (uint32 length 25) holding ctime()'s
# "Www Mmm dd hh:mm:ss yyyy\n", written by model_tool --combine. It is the only
# thing that differs between two builds of the same graphs.
_BMODEL_MAGIC = 0xFF55AAEE
_BUILD_TIME = re.compile(
    rb"\x19\x00\x00\x00[A-Z][a-z]{2} [A-Z][a-z]{2} [ 0-9][0-9] "
    rb"[0-9]{2}:[0-9]{2}:[0-9]{2} [0-9]{4}\n\x00"
)


def pin_build_time(bmodel, epoch=None) -> str:
    """Set the bmodel's build-time string to ``epoch`` (default $SOURCE_DATE_EPOCH or 0).

    Same length, same flatbuffer layout: only those 24 characters change, so two
    builds of the same graphs give identical bytes. Returns the time written.
    """
    if epoch is None:
        epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    stamp = time.asctime(time.gmtime(epoch)).encode()
    data = bytearray(Path(bmodel).read_bytes())
    magic, header_size, flatbuffer_size = struct.unpack_from("<III", data)
    if magic != _BMODEL_MAGIC:
        raise NpuforgeError(f"{bmodel} is not a bmodel (magic {magic:#x})")
    region = bytes(data[header_size : header_size + flatbuffer_size])
    found = list(_BUILD_TIME.finditer(region))
    if len(found) != 1:
        raise NpuforgeError(
            f"{bmodel}: expected one build-time string in the bmodel header, found "
            f"{len(found)}: this TPU-MLIR writes bmodels differently, check pin_build_time"
        )
    start = header_size + found[0].start() + 4
    data[start : start + len(stamp)] = stamp
    Path(bmodel).write_bytes(bytes(data))
    return stamp.decode()
