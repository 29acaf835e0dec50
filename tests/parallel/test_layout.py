"""Layout: one error naming every wrong degree and what would fit; the mesh's groups."""

from __future__ import annotations

import dataclasses

import pytest

import emulator
from emulator.model import ModelConfig
from parallel import Layout

CFG = ModelConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=2, n_layers=2)


def test_one_error_names_every_problem_and_what_would_fit():
    bad = Layout(dp=2, pp=4, tp=3, cp=2, ep=2, microbatches=3, sequence_parallel=True)
    with pytest.raises(ValueError) as e:
        bad.validate(8, CFG, (8, 5))
    msg = str(e.value)
    for fragment in (
        "dp*pp*cp*tp = 2*4*2*3 = 48 but the world has 8 ranks",
        "S=5 does not split into cp=2 ranks' S/cp positions cut into tp=3",  # cp x SP
        "ep=2 needs an MoE model",  # ep
        "tp=3 does not divide n_heads=2",
        "tp could be one of [1, 2]",
        "tp=3 does not divide vocab_size=16",
        "4*1 = 4 virtual stages but the model has only 2 blocks",
        "batch B=8 is not divisible by dp*microbatches = 2*3 = 6; microbatches could be one of [1, 2, 4]",
    ):  # fmt: skip
        assert fragment in msg, (fragment, msg)
    assert msg.count("\n  - ") == 9  # one line per problem (d_ff, d_model, cp x SP S too)


@pytest.mark.parametrize(
    "kw,fragment",
    [
        ({"dp": 3}, "dp=4 would fit with pp=1, cp=1, tp=2"),
        ({"zero": 4}, "zero=4"),
        ({"dtype": "fp8"}, "dtype='fp8'"),
        ({"recompute": "full"}, "recompute='full' is not supported with the tensor-parallel"),
        ({"schedule": "pipedream"}, "schedule='pipedream'"),
        ({"schedule": "interleaved", "chunks": 2, "pp": 2, "dp": 2, "microbatches": 3},
         "schedule 'interleaved' with pp=2"),
        ({"schedule": "zb-h1", "zero": 3}, "zero=3 with zb-h1"),
        ({"microbatches": 0}, "microbatches=0 must be an int >= 1"),
    ],
)  # fmt: skip
def test_each_refusal_says_why(kw, fragment):
    layout = Layout(**({"dp": 4, "tp": 2} | kw))
    assert layout.problems(8, CFG, (8, 4))
    with pytest.raises(ValueError, match="cannot run"):
        layout.validate(8, CFG, (8, 4))
    assert fragment in "\n".join(layout.problems(8, CFG, (8, 4)))


def test_valid_layouts_pass_and_print():
    layout = Layout(dp=2, pp=2, tp=2, zero=3, sequence_parallel=True, microbatches=2)
    assert layout.validate(8, CFG, (8, 4)) is layout
    assert str(layout) == (
        "Layout(dp2 x pp2 x tp2 = 8 ranks; zero=3, sequence_parallel=True, microbatches=2)"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.dp = 4


def test_mesh_groups_tp_innermost_and_every_axis_a_partition():
    def main(comm):
        mesh = Layout(dp=2, pp=2, tp=2).mesh(comm)
        return mesh.describe(), {a: mesh.ranks(a) for a in mesh.names}

    runs = emulator.spawn(main, 8)
    text = runs[0][0]
    assert "tp groups: [0,1] [2,3] [4,5] [6,7]" in text  # neighbours
    assert "pp groups: [0,2] [1,3] [4,6] [5,7]" in text
    assert "dp groups: [0,4] [1,5] [2,6] [3,7]" in text
    for rank, (_, groups) in enumerate(runs):  # independent: rank = ((d*2 + p)*1 + c)*2 + t
        d, p, t = rank // 4, rank // 2 % 2, rank % 2
        assert groups["tp"] == [4 * d + 2 * p + k for k in range(2)]
        assert groups["pp"] == [4 * d + 2 * k + t for k in range(2)]
        assert groups["dp"] == [4 * k + 2 * p + t for k in range(2)]
        assert f"[{','.join(map(str, groups['dp']))}]" in text


def test_mesh_text_is_every_rank_s_describe_for_each_shape():
    """mesh_text shares one string per (axes, degrees): it must equal each rank's own
    Mesh.describe() for meshes of the same world in different shapes, asked in turn."""
    from parallel.layout import mesh_text

    shapes = [{"dp": 2, "pp": 2, "tp": 2}, {"dp": 4, "tp": 2}, {"pp": 2, "tp": 4}, {"dp": 8}]

    def main(comm):
        meshes = [Layout(**kw).mesh(comm) for kw in shapes]
        return [(mesh_text(m), m.describe()) for m in meshes]

    for rank in emulator.spawn(main, 8):
        assert [a for a, _ in rank] == [b for _, b in rank]
        assert len({a for a, _ in rank}) == len(shapes)
