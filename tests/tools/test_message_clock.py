"""`bench layouts --costs`'s MessageClock: the CPU it finds in the emulator's communication
calls, by kind, against each rank's own thread clock (its outermost calls only)."""

import time

import numpy as np

import emulator
from benchmarks import layout_costs, layouts
from collectives import all_reduce
from emulator.local import VirtualComm
from emulator.mpi_call import OpenCall

KINDS = layout_costs.MessageClock.KINDS


def _clocked(body, ranks=4):
    clock = layout_costs.MessageClock()
    with clock.clocked():
        spent = emulator.spawn(body, ranks, timeout=60)
    return clock, spent


def test_collectives_only_the_outer_call_counts_and_inside_the_ranks_cpu():
    def body(comm):
        x = np.arange(8192, dtype=np.float64) + comm.rank
        t = time.thread_time()
        for _ in range(20):
            all_reduce(comm, x, algorithm="ring")  # 6 sendrecv steps each, inside the call
        return time.thread_time() - t

    clock, spent = _clocked(body)
    ranks_cpu = sum(spent)
    assert clock.calls == {"collectives": 80, "point-to-point": 0, "control plane": 0}
    # nothing but collectives ran in the timed loops: the clock finds most of it, never more
    assert 0.5 * ranks_cpu < clock.cpu["collectives"] <= ranks_cpu * 1.05 + 1e-3


def test_point_to_point_and_the_control_plane_are_their_own_kinds():
    def body(comm):
        for _ in range(3):
            if comm.rank == 0:
                comm.send(np.ones(16), 1)
            else:
                comm.recv(0, shape=(16,), dtype=np.float64)
        comm.barrier()  # a control-plane gather inside: one call
        comm.allgather_object(comm.rank)

    clock, _ = _clocked(body, ranks=2)
    assert clock.calls == {"collectives": 0, "point-to-point": 6, "control plane": 4}
    assert clock.cpu["collectives"] == 0 < clock.cpu["point-to-point"]
    assert clock.cpu["control plane"] > 0


def test_no_communication_is_nothing_and_the_patches_are_undone():
    before = OpenCall.__enter__, OpenCall.__exit__, VirtualComm.sendrecv
    clock, _ = _clocked(lambda comm: np.linalg.norm(np.ones((64, 64)) @ np.ones((64, 64))))
    assert clock.calls == dict.fromkeys(KINDS, 0) and clock.cpu == dict.fromkeys(KINDS, 0.0)
    assert (OpenCall.__enter__, OpenCall.__exit__, VirtualComm.sendrecv) == before


def test_the_messages_free_row_of_ddp_and_pp4():
    cases = {c.label: c for c in layouts.cases()}
    for label, p2p in (("DDP", False), ("pp4 1f1b m4", True)):
        m = layout_costs.messages_free(cases[label], "small", 1)
        assert m["collectives"][0] > 0 and (m["point-to-point"][0] > 0) == p2p, label
        row = layout_costs.messages_row(cases[label], m)
        assert len(row) == len(layout_costs.MESSAGE_COLUMNS)
        rest = float(row[6])
        assert 0 < rest < float(row[2]), row
