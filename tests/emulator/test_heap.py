"""emulator/heap.py: with its settings on, a second round of the same arrays reuses the first
round's pages (no page faults) - on the main thread, when the freed top of the heap is over a
GiB (the trim threshold is off, not just high), and on new threads (virtual ranks) that each
allocate and free more than one 64 MiB arena heap's worth; with glibc's defaults
(DISTEMU_KEEP_HEAP=0) the pages fault back in. Counted by the kernel (getrusage minor faults) in
fresh processes, since mallopt is per process. Linux + glibc only."""

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only"
)

# one_round() allocates and frees the arrays and returns their bytes; run twice, the second counted
MEASURE = """
import json, resource, threading
import numpy as np
import emulator.ops  # noqa: F401 - calls heap.keep_freed_memory() on import
from emulator import heap
{one_round}
one_round()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
nbytes = one_round()
f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
print(json.dumps({{"kept": heap.keep_freed_memory(), "faults": f1 - f0, "pages": nbytes // 4096}}))
"""

MAIN_THREAD = """
def one_round():  # a forward's worth of 4 MiB arrays, all freed at the end like a backward
    arrays = [np.ones(1 << 19) for _ in range(16)]  # 16 x 4 MiB, each page touched
    return sum(a.nbytes for a in arrays)
"""

THREADS = """
def one_round():  # 4 new threads (as a spawn starts), each 24 x 4 MiB arrays, all freed
    held = threading.Barrier(4, timeout=60)  # all 4 hold theirs at once in both rounds: the
    # same peak whatever the scheduling (a round that ran them one by one peaked at a quarter)
    def rank():
        arrays = [np.ones(1 << 19) for _ in range(24)]  # 96 MiB: more than one arena heap
        held.wait()
        del arrays
    threads = [threading.Thread(target=rank) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return 4 * 24 * (1 << 22)
"""

OVER_A_GIB = """
def one_round():  # 1.25 GiB of arrays freed at once: the heap's top over a 1 GiB trim threshold
    arrays = [np.ones(1 << 19) for _ in range(320)]  # (a dp2 x ep2 spawn at H 256 frees 1.9 GiB)
    return sum(a.nbytes for a in arrays)
"""


def _round(one_round: str, keep: str) -> dict:
    env = dict(os.environ, DISTEMU_KEEP_HEAP=keep)
    env.pop("MALLOC_ARENA_MAX", None)
    script = MEASURE.format(one_round=one_round)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    return json.loads(out.stdout)


def test_second_round_reuses_the_pages():
    got = _round(MAIN_THREAD, "1")
    assert got["kept"] is True
    assert got["faults"] < got["pages"] // 20, got  # 16,384 pages; Python itself takes a few


def test_glibc_defaults_fault_the_pages_back_in():
    got = _round(MAIN_THREAD, "0")  # the baseline the module exists for
    assert got["kept"] is False
    assert got["faults"] > got["pages"] // 4, got  # measured about half of them


def test_threads_second_round_reuses_the_pages():
    got = _round(THREADS, "1")
    assert got["kept"] is True
    assert got["faults"] < got["pages"] // 100, got  # 98,304 pages; measured 4 faults


def test_threads_fault_pages_back_in_with_glibc_defaults():
    got = _round(THREADS, "0")
    assert got["kept"] is False
    assert got["faults"] > got["pages"] // 20, got  # measured 10-50% of them


def test_a_heap_top_over_a_gib_is_kept():
    got = _round(OVER_A_GIB, "1")  # a finite trim threshold hands it back and faults it in again
    assert got["kept"] is True
    assert got["faults"] < got["pages"] // 100, got  # 327,680 pages
