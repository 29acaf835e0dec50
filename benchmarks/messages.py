"""Per-message cost on virtual ranks beside a bare deque + Condition mailbox (a benchmark).

    python -m emulator bench messages [--messages 20000] [--rounds 5] [--size 8]

Two threads, two patterns: "stream" (rank 0 sends N messages, rank 1 receives them: mostly no
waiting, the pure software cost) and "ping-pong" (each message answered before the next: every
receive sleeps and is woken, the hand-off cost). CPU microseconds per message = process CPU
time of the run / N (send + receive of one message together). "bare" is the least a mailbox
can do with the same guarantees: the receiver gets a private copy (np.array(copy=True)), FIFO
per pair, a Condition to sleep on, a deadline on every wait. "ours" is `Comm.send` /
`Comm.recv` on `spawn`'s ranks: argument checks, the byte ledger (a Record per side), the
channel, the failure check. Rounds interleave bare and ours; the best of each is compared.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import deque

import numpy as np


class _Bare:
    """deque + Condition per receiver; copy on send; deadline on every wait."""

    def __init__(self):
        self.cond = threading.Condition(threading.Lock())
        self.q: deque = deque()

    def send(self, x):
        msg = np.array(x, copy=True)
        with self.cond:
            self.q.append(msg)
            self.cond.notify()

    def recv(self, timeout=60.0):
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.q:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("bare mailbox: nothing arrived")
                self.cond.wait(left)
            return self.q.popleft()


def _bare(pattern: str, n: int, x) -> float:
    boxes = [_Bare(), _Bare()]

    def rank(r):
        other = 1 - r
        for _ in range(n):
            if pattern == "stream":
                boxes[other].send(x) if r == 0 else boxes[r].recv()
            elif r == 0:
                boxes[other].send(x)
                boxes[r].recv()
            else:
                boxes[r].recv()
                boxes[other].send(x)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    t0 = time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.process_time() - t0


def _ours(pattern: str, n: int, x) -> float:
    import emulator

    def rank(c):
        other = 1 - c.rank
        for _ in range(n):
            if pattern == "stream":
                c.send(x, other) if c.rank == 0 else c.recv(other, shape=x.shape, dtype=x.dtype)
            elif c.rank == 0:
                c.send(x, other)
                c.recv(other, shape=x.shape, dtype=x.dtype)
            else:
                c.recv(other, shape=x.shape, dtype=x.dtype)
                c.send(x, other)
        return c.ledger.sent()

    t0 = time.process_time()
    sent = emulator.spawn(rank, 2)
    t = time.process_time() - t0
    per = x.nbytes * n  # stream: rank 0 sends n messages; ping-pong: each rank sends n
    assert sent == ([per, 0] if pattern == "stream" else [per, per]), sent  # bytes are exact
    return t


def main(argv=None) -> int:
    from emulator.ledger import format_table

    ap = argparse.ArgumentParser(prog="bench messages", description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=20000, help="messages per run (N)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; best shown")
    ap.add_argument("--size", type=int, default=8, help="message bytes (float64 elements * 8)")
    args = ap.parse_args(argv)
    if args.messages < 1 or args.rounds < 1 or args.size < 8 or args.size % 8:
        raise SystemExit("bench messages: --messages, --rounds >= 1; --size a multiple of 8")
    x = np.ones(args.size // 8)
    rows = []
    for pattern in ("stream", "ping-pong"):
        msgs = args.messages * (1 if pattern == "stream" else 2)
        bare, ours = [], []
        for _ in range(args.rounds):
            bare.append(_bare(pattern, args.messages, x) / msgs * 1e6)
            ours.append(_ours(pattern, args.messages, x) / msgs * 1e6)
        b, o = min(bare), min(ours)
        rows.append([pattern, f"{b:.1f}", f"{o:.1f}", f"{o / b:.2f}x"])
    print(
        f"CPU us per message ({args.size} B, {args.messages} per run, best of {args.rounds} "
        f"interleaved rounds; goal ours/bare <= 1.5x)"
    )
    print(format_table(["pattern", "bare us", "ours us", "ours/bare"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
