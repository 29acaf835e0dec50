"""The MPI backend's control plane: labelled exchanges with a deadline, and the end-of-run check.

Every control-plane message (collective checks, object gathers, group-membership checks, the
end-of-run check) is one point-to-point message on the group's communicator, under tag 1 (the
group's own exchanges) or 2 (creating a subgroup), which data messages never use:

    [8-byte length L][L bytes: utf-8 label][payload]

The label says what the sender is doing ("all_reduce#3(algorithm='ring', ...)", "a control-plane
object gather", "group 'tp' over world ranks [0, 1], creation #0"). Every rank sends its message
to every other rank of the exchange and receives theirs, so each rank sees every label and they all
reach the same verdict: equal labels pass, any difference is a `CollectiveMismatch` naming both
ranks and both labels - a control-plane call against a counted collective included. A wait that
expires names the ranks whose messages never came. Cost: p-1 small messages per rank per exchange
(a 2-rank collective check measured 6 us against 9 us for an Iallgather of 16 bytes). A
collective's check is an `Exchange` left in flight while the data moves (`emulator.mpi`).

`MPIWorld` counts each group's messages and bytes per peer (payload bytes, as the ledger); at the
end of a run `finish` exchanges the counts, and a message sent but never received is an error
naming sender, receiver and size.
"""

from __future__ import annotations

import functools
import os
import pickle
import time

import numpy as np

from .comm import CollectiveMismatch, CommError, CommTimeout, mismatch_message

EAGER = 1024  # bytes: a control message this short (below the eager limits of MPICH and Open
# MPI shared memory, 4 KiB) has fully arrived once probed, so Exchange receives it outright
CTRL_TAG = 1  # a group's own control exchanges (collective checks, object gathers, the end)
GROUP_TAG = 2  # group-membership checks, on the parent group's communicator
OBJECTS = "a control-plane object gather (allgather_object / gather_object / barrier())"
SPIN = 5e-5  # seconds of bare polling before a wait yields its core, when ranks <= cores (poll)
END = "the end-of-run check (its program returned; launch's final handshake)"


@functools.cache
def _mpi():
    from mpi4py import MPI

    return MPI


_BYTE = None  # MPI.BYTE, once looked up (_byte)


def _byte():
    global _BYTE
    _BYTE = _mpi().BYTE
    return _BYTE


@functools.cache
def _status():
    """One MPI.Status for every Exchange's probes: each is read right after its probe, and a
    process has one thread of MPI calls, so they never overlap."""
    return _mpi().Status()


def poll(done, timeout: float, report, spin: float = 0.0) -> None:
    """Wait until done() is true, at most `timeout` s; then raise CommTimeout(report()).

    Three phases. First `spin` s of bare polls (MPIWorld.spin: SPIN when every rank has a core
    of its own, else 0): a peer that answers within microseconds (the common case of a
    collective's step) is seen at once, as MPI's own blocking calls spin. Then polls that give
    the core away: ranks often outnumber cores (4 ranks on a 2-core laptop), and a spinning
    rank would starve the peer it waits for; sched_yield returns at once when nothing else is
    runnable. After 50 ms we sleep between polls so a long wait does not burn a core.
    """
    if done():
        return
    start = time.monotonic()
    deadline = start + timeout
    spin = start + spin
    while not done():
        now = time.monotonic()
        if now < spin:
            continue
        if now > deadline:
            raise CommTimeout(report())
        if now - start < 0.05:
            os.sched_yield()
        else:
            time.sleep(2e-4)


class Exchange:
    """One labelled exchange in flight: our (label, payload) posted to every peer, theirs
    received as they come. `progress()` advances it without blocking and says whether every
    peer's message is in; `wait(what)` blocks (with the deadline) until then. `peers` maps each
    other rank's index in `mpicomm` to its world rank (for messages); `comm` is the MPIComm on
    whose behalf we wait (its timeout, rank and flight recorder)."""

    __slots__ = ("comm", "got", "label", "mpicomm", "payload", "peers", "probing", "raw",
                 "receiving", "same", "status", "tag")  # fmt: skip

    def __init__(self, comm, mpicomm, peers: dict, label: str, payload: bytes, tag: int,
                 post: bool = True):  # fmt: skip
        text = label.encode()
        self.raw = len(text).to_bytes(8, "little") + text + payload  # bytes: sent as they are
        self.comm, self.mpicomm, self.peers, self.label = comm, mpicomm, peers, label
        self.payload = payload
        self.got: dict = {}
        self.same = 0  # peers whose message is byte for byte ours (verify has nothing to do)
        self.probing, self.tag = set(peers), tag
        self.receiving: list = []
        self.status = _status()
        if post:
            self.post()

    def post(self) -> None:
        """Send our message to every peer (once: a collective's check, `MPIComm._check`, leaves
        it to the caller)."""
        raw, mpicomm, tag, world = self.raw, self.mpicomm, self.tag, self.comm.world
        pending = world.pending
        for p in self.peers:
            pending.append((mpicomm.Isend(raw, p, tag), raw))
        if len(pending) > 32:  # (world.prune's own test, without its call on every check)
            world.prune()

    def progress(self) -> bool:
        probing = self.probing
        if probing:
            status, mpicomm, tag = self.status, self.mpicomm, self.tag
            for p in list(probing):
                m = mpicomm.Improbe(p, tag, status)
                if m is None:
                    continue
                probing.discard(p)
                n = status.Get_count(_BYTE or _byte())
                if n <= EAGER:  # a short message is all here once matched: take it now
                    buf = bytearray(n)
                    m.Recv(buf)
                    if buf == self.raw:  # the same call (the common case): _took's, inlined
                        self.got[p] = (self.label, self.payload)
                        self.same += 1
                    else:
                        self._took(p, buf)
                else:  # a long one may still be in transfer: a request, tested with the deadline
                    buf = np.empty(n, np.uint8)
                    self.receiving.append((p, m.Irecv(buf), buf))
        if self.receiving:
            for item in list(self.receiving):
                p, req, buf = item
                if req.Test():
                    self._took(p, buf.tobytes())
                    self.receiving.remove(item)
        return not self.probing and not self.receiving

    def _took(self, p: int, buf) -> None:  # buf: bytes or bytearray
        if buf == self.raw:  # the same call (the common case): nothing to decode
            self.got[p] = (self.label, self.payload)
            self.same += 1
            return
        raw = bytes(buf)
        n = int.from_bytes(raw[:8], "little")
        self.got[p] = (raw[8 : 8 + n].decode(), raw[8 + n :])

    def report(self, what: str) -> str:
        comm = self.comm
        missing = sorted(self.peers[p] for p in self.peers if p not in self.got)
        return (
            f"rank {comm.state.rank} waited {comm.world.timeout:g} s {what} in group "
            f"{comm.name!r}: rank(s) {missing} never arrived (they exited, are stuck, or called "
            f"something else). Under MPI each rank reports its own flight recorder:\n  "
            f"{comm.state.flight()}"
        )

    def wait(self, what: str, timeout: float | None = None) -> dict:
        t = self.comm.world.timeout if timeout is None else timeout
        poll(self.progress, t, lambda: self.report(what), self.comm.world.spin)
        return self.got


def exchange(comm, mpicomm, peers: dict, label: str, payload: bytes, tag: int, what: str) -> dict:
    """Send (label, payload) to every peer and receive theirs: {peer: (label, payload)}."""
    return Exchange(comm, mpicomm, peers, label, payload, tag).wait(what)


def verify(comm, label: str, got: dict) -> None:
    """Every peer's label in `got` must equal ours, else a CollectiveMismatch naming both."""
    for j in sorted(got):
        if got[j][0] != label:
            mine, theirs = (comm.state.rank, label), (comm.ranks[j], got[j][0])
            raise CollectiveMismatch(mismatch_message(comm.name, mine, theirs))


def gather(comm, label: str, payload: bytes, what: str) -> list:
    """Every rank of `comm` exchanges (label, payload) on its control communicator; a differing
    label anywhere is a CollectiveMismatch on every rank. Returns the payloads in rank order."""
    peers = {j: comm.ranks[j] for j in range(comm.world_size) if j != comm.rank}
    got = exchange(comm, comm.ctrl, peers, label, payload, CTRL_TAG, what)
    verify(comm, label, got)
    got[comm.rank] = (label, payload)
    return [got[j][1] for j in range(comm.world_size)]


class Traffic:
    """One group's point-to-point counts on this rank, per peer (group rank): messages, bytes."""

    __slots__ = ("name", "ranks", "recv_b", "recv_n", "sent_b", "sent_n")

    def __init__(self, name: str, ranks: tuple):
        self.name, self.ranks = name, ranks
        p = len(ranks)
        self.sent_n, self.sent_b, self.recv_n, self.recv_b = [0] * p, [0] * p, [0] * p, [0] * p


class MPIWorld:
    def __init__(self, timeout: float, check: bool):
        self.timeout = float(timeout)
        self.check = check
        self.pending: list = []  # (request, buffer): eager sends not yet known complete
        self.lent: list = []  # (request, buffer, peer): the open collective's uncopied sends
        self.unposted = None  # the open collective's check until its label is sent (mpi.py)
        self.traffic: dict = {}  # group key -> Traffic
        self.live_groups = 0
        ranks = _mpi().COMM_WORLD.Get_size()
        self.spin = SPIN if ranks <= len(os.sched_getaffinity(0)) else 0.0  # see poll

    def counts(self, key, name: str, ranks: tuple) -> Traffic:
        t = self.traffic.get(key)
        if t is None:
            t = self.traffic[key] = Traffic(name, ranks)
        return t

    def prune(self) -> None:
        # One Testall for the lot (one progress pass; almost always all done, as these are
        # short eager sends), one Test each only when some are still in flight.
        pending = self.pending
        if len(pending) > 32:
            if _mpi().Request.Testall([req for req, _ in pending]):
                pending.clear()
            else:
                pending[:] = [p for p in pending if not p[0].Test()]

    def finish(self, comm, ok: bool = True) -> list:
        """The end-of-run handshake on the world `comm`; returns every rank's verdict.

        Every rank sends its message counts; a message one rank sent and its peer never received
        (a stray send, consumed by nothing) is a CommError on every rank naming sender, receiver
        and size. A rank that exited or hangs never arrives: a CommTimeout names it. Then every
        outstanding eager send is complete (each was received), and we wait for them.
        """
        mine = {
            key: (t.name, t.ranks, t.sent_n, t.sent_b, t.recv_n, t.recv_b)
            for key, t in self.traffic.items()
            if any(t.sent_n) or any(t.recv_n)
        }
        payload = pickle.dumps((bool(ok), mine))
        every = [pickle.loads(b) for b in gather(comm, END, payload, "at the end-of-run check")]
        problems = leftovers([t for _, t in every])
        if problems:
            raise CommError(
                "messages left over at the end of the run (sent, never received - a stray "
                "send):\n  " + "\n  ".join(problems)
            )
        for req, _ in self.pending:
            comm._wait(req.Test, "for a sent message to be received at exit")
        self.pending.clear()
        return [v for v, _ in every]


def leftovers(tables: list) -> list:
    """Sent-but-not-received counts, one line per (group, sender, receiver); world ranks."""
    out = []
    for a, table in enumerate(tables):
        for key, (name, ranks, sent_n, sent_b, _, _) in table.items():
            me = ranks.index(a)
            for j, b in enumerate(ranks):
                theirs = tables[b].get(key)
                got_n, got_b = (theirs[4][me], theirs[5][me]) if theirs else (0, 0)
                if sent_n[j] != got_n:
                    n, nb = sent_n[j] - got_n, sent_b[j] - got_b
                    out.append(
                        f"rank {a} sent {n} message(s) ({nb} bytes) to rank {b} in group "
                        f"{name!r} that rank {b} never received"
                    )
    return out
