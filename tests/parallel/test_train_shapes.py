"""parallel.train validates the layout once per batch shape: a step whose batch has another
shape is validated again (the layout's own ValueError, naming the problem), one with the same
shape is not re-checked (validate depends on the shape only)."""

import pytest

import emulator
import parallel
from emulator.data import synthetic_batch
from emulator.model import ModelConfig
from parallel.layout import Layout

CFG = ModelConfig(vocab_size=32, max_seq_len=8, d_model=16, n_heads=2, n_layers=2)


def test_a_later_batch_of_another_shape_is_validated_again():
    batches = [synthetic_batch(0, 0, 4, 8, 32), synthetic_batch(0, 1, 6, 8, 32)]  # B 4, then 6

    def prog(comm):
        with pytest.raises(ValueError, match="cannot run") as err:
            parallel.train(comm, Layout(dp=2, microbatches=2), CFG, batches, 2)
        return str(err.value)

    msgs = emulator.spawn(prog, 2)
    assert all("micro" in m for m in msgs), msgs[0]  # B/D = 3 rows cannot make 2 micro-batches


def test_same_shape_steps_train():
    def batches(step):
        return synthetic_batch(0, step, 4, 8, 32)

    runs = emulator.spawn(lambda c: parallel.train(c, Layout(dp=2), CFG, batches, 3), 2)
    assert len(runs[0].losses) == 3 and runs[0].losses == runs[1].losses
