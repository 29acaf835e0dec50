"""The emulator: ranks, messages, accounting, and the single-rank model.

import emulator
results = emulator.spawn(fn, world_size=8)      # fn(comm) on 8 virtual ranks
sys.exit(emulator.launch(main))                 # a script that also runs under mpiexec
"""

from .comm import (
    CollectiveMismatch,
    Comm,
    CommError,
    CommTimeout,
    PeerExited,
    RankAborted,
    UnreceivedMessage,
    current_state,
    scope,
)
from .launcher import launch, under_mpi
from .ledger import Ledger, Record, format_table, world_table
from .local import spawn
from .memory import MemoryLedger
from .mesh import Mesh

DeviceMesh = Mesh  # the torch name

__all__ = [
    "CollectiveMismatch",
    "Comm",
    "CommError",
    "CommTimeout",
    "DeviceMesh",
    "Ledger",
    "MemoryLedger",
    "Mesh",
    "PeerExited",
    "RankAborted",
    "Record",
    "UnreceivedMessage",
    "current_state",
    "format_table",
    "launch",
    "scope",
    "spawn",
    "under_mpi",
    "world_table",
]
