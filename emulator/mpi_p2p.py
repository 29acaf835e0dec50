"""User point-to-point messages on the MPI backend: the 64-byte header and the probed receive.

A user message (tag 0, outside any collective) carries a HEADER-byte prefix naming its dtype and
shape (uncounted, like the checks): "float64[2, 4]\0\0...". The receiver probes first, so the
message's size is known before it is received: a message of another size or kind is named from
its header, never truncated. A collective's messages carry no header (its check compares every
rank's call instead; `emulator.mpi`).
"""

from __future__ import annotations

import functools
import hashlib
import math

import numpy as np

from .comm import CommError
from .mpi_control import _mpi

HEADER = 64  # bytes before a user point-to-point message's payload: "float64[2, 4]\0\0..."


@functools.lru_cache(maxsize=4096)
def _header(dtype: np.dtype, shape: tuple) -> bytes:
    """What a user message is, in HEADER bytes; long shapes keep a prefix and a digest."""
    text = f"{dtype}{list(shape)}".encode()
    if len(text) > HEADER:
        text = text[:40] + b"..#" + hashlib.blake2b(text, digest_size=8).hexdigest().encode()
    return text.ljust(HEADER, b"\0")


def with_header(array: np.ndarray) -> np.ndarray:
    """The header, then the payload, in one uint8 buffer (one copy)."""
    buf = np.empty(HEADER + array.nbytes, np.uint8)
    buf[:HEADER] = np.frombuffer(_header(array.dtype, array.shape), np.uint8)
    buf[HEADER:].view(array.dtype).reshape(array.shape)[...] = array
    return buf


def take_user(comm, src: int, shape, dtype) -> np.ndarray:
    """Receive the next user message from group rank `src` on `comm` (an MPIComm), with its
    deadline; a message of another dtype, shape or size is a CommError naming both sides."""
    MPI = _mpi()
    status, found = MPI.Status(), []

    def arrived() -> bool:
        m = comm.mpi.Improbe(source=src, tag=0, status=status)
        if m is not None:
            found.append(m)
        return bool(found)

    comm._wait(arrived, f"to receive from rank {comm.ranks[src]}")
    buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
    req = found[0].Irecv(buf)
    comm._wait(req.Test, f"to receive from rank {comm.ranks[src]}")
    nbytes = np.dtype(dtype).itemsize * math.prod(shape)
    mine = _header(np.dtype(dtype), tuple(shape))
    if buf.size != HEADER + nbytes or buf[:HEADER].tobytes() != mine:
        theirs = buf[:HEADER].tobytes().rstrip(b"\0").decode(errors="replace")
        expected = mine.rstrip(b"\0").decode()
        raise CommError(
            f"rank {comm.state.rank} expected {expected} ({nbytes} "
            f"bytes) from rank {comm.ranks[src]} in group {comm.name!r} but rank "
            f"{comm.ranks[src]} sent {theirs} ({buf.size - HEADER} bytes); sender and "
            f"receiver disagree about the message (check both sides' shapes and dtypes)"
        )
    return buf[HEADER:].view(dtype).reshape(shape)
