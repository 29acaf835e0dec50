"""emulator/heap.py: with the thresholds raised, a second round of the same arrays reuses the
first round's pages (no page faults); with glibc's defaults (DISTEMU_KEEP_HEAP=0) it faults them
all back in. Counted by the kernel (getrusage minor faults) in fresh processes, since mallopt is
per process. Linux + glibc only."""

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only"
)

ROUND = """
import json, resource, sys
import numpy as np
import emulator.ops  # noqa: F401 - calls heap.keep_freed_memory() on import
from emulator import heap

def one_round():  # a forward's worth of 4 MiB arrays, all freed at the end like a backward
    arrays = [np.ones(1 << 19) for _ in range(16)]  # 16 x 4 MiB, each page touched
    return sum(a.nbytes for a in arrays)

one_round()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
nbytes = one_round()
f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(json.dumps({"kept": heap.keep_freed_memory(), "faults": f1 - f0, "pages": nbytes // 4096}))
"""


def _round(keep: str) -> dict:
    env = dict(os.environ, DISTEMU_KEEP_HEAP=keep)
    out = subprocess.run([sys.executable, "-c", ROUND], env=env, capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    return json.loads(out.stdout)


def test_second_round_reuses_the_pages():
    got = _round("1")
    assert got["kept"] is True
    assert got["faults"] < got["pages"] // 20, got  # 16,384 pages; Python itself takes a few


def test_glibc_defaults_fault_the_pages_back_in():
    got = _round("0")  # the baseline the module exists for: without it every page faults again
    assert got["kept"] is False
    assert got["faults"] > got["pages"] // 4, got  # measured about half of them
