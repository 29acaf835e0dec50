"""Parallel layouts, a folder per axis, each checked against emulator/reference.py.

data/      DDP, ZeRO-1/2/3, FSDP units          tensor/    Megatron TP, SP, vocab-parallel
pipeline/  schedules, executor, bubble          check/     comparing runs with the reference
clip.py    global-norm clipping for every layout
"""
