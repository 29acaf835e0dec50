"""A testing kit for your own sharding: strategies, a virtual world, layout assertions.

    from parallel.testing import check_layout, assert_bytes, assert_memory, on_virtual_ranks
    from parallel.testing import strategies as dst       # hypothesis strategies (needs hypothesis)

strategies.py   world sizes, meshes, uneven lengths, model configs, batches, routing groups,
                pipeline schedules (built-in and random valid action lists)
layouts.py      N-D layouts for parallel.train: valid by construction, and invalid ones with
                the reason they must be refused
assertions.py   check_layout(Layout or your train function) / assert_matches_reference (every rank vs the single-rank
                reference), assert_bytes (per scope tag, exact), assert_memory (per category)
world.py        the `virtual_world` pytest fixture and the @on_virtual_ranks(n) decorator
Load the fixture with `pytest_plugins = ["parallel.testing.world"]` in your conftest.py.
See docs/testing.md.
"""

from .assertions import assert_bytes, assert_matches_reference, assert_memory, check_layout
from .world import on_virtual_ranks, run_on_virtual_ranks

__all__ = [
    "assert_bytes",
    "assert_matches_reference",
    "assert_memory",
    "check_layout",
    "on_virtual_ranks",
    "run_on_virtual_ranks",
]
