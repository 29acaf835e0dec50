"""Parallel layouts, a folder per axis, each checked against emulator/reference.py.

layout.py  Layout: the degrees and features of a run, validated; its Mesh (dp, pp, cp, tp)
train.py   parallel.train(comm, layout, cfg, batches, steps): the ONE program for every layout
layer.py   LayerContext: which function computes each layer on this rank (single / TP / SP)
data/      DDP, ZeRO-1/2/3, FSDP units, the dp axis hooks   tensor/  Megatron TP, SP, vocab
pipeline/  schedules, the executor (the model driver), bubble   check/  comparing with the reference
expert/    expert parallelism (ep_train on train.py)     context/  context parallelism (cp_train)
testing/   a kit for checking your own layouts
clip.py    global-norm clipping for every layout          nd_cost.py  per-axis byte/memory formulas
"""

from parallel.layout import Layout
from parallel.train import NDRun, train

__all__ = ["Layout", "NDRun", "train"]
