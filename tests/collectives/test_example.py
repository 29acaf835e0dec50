"""examples/01_collectives.py passes on virtual ranks (its MPI run is in .ci)."""

from __future__ import annotations

import runpy
from pathlib import Path

import emulator

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "01_collectives.py"


def test_example_passes_on_5_virtual_ranks(capsys):
    main = runpy.run_path(str(EXAMPLE))["main"]
    assert emulator.spawn(main, 5, timeout=20) == [0] * 5
    out = capsys.readouterr().out
    assert "VERDICT: PASS" in out and "NO" not in out.split()
