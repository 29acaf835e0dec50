"""Expert parallelism dry-runs exactly under its stated routing assumption (padded to capacity):
on every rank of ep_train's dp x ep, bytes per (tag, op, algorithm, direction, peer, group) and
memory (current and peak per category) equal the real run's; rank 0 stands for every rank; exact
dispatch (sizes follow the routing) is refused by name."""

import pytest

from emulator.config import ModelConfig
from planning.dryrun import role_figures
from planning.ep_dryrun import dry_ep, real_ep, representatives


def cfg_of(E=4, K=2):
    return ModelConfig(vocab_size=30, max_seq_len=8, d_model=12, n_heads=2, n_layers=2,
                       n_experts=E, moe_top_k=K, dtype="mixed")  # fmt: skip


@pytest.mark.parametrize(
    "world, ep, kw",
    [
        (2, 2, {}),
        (4, 2, {"microbatches": 2, "grad_sync": "ddp"}),
        (4, 4, {"recompute": "selective"}),
    ],
    ids=str,
)
def test_padded_ep_dry_run_equals_the_real_run(world, ep, kw):
    cfg, B, S = cfg_of(), world * kw.get("microbatches", 1) * 2, 8
    real = real_ep(cfg, world, ep, B, S, dispatch="padded", **kw)
    dry = dry_ep(cfg, world, ep, B, S, ranks=range(world), **kw)
    for r in range(world):
        assert dry[r]["figures"]["bytes"] == real[r]["bytes"], f"rank {r} bytes"
        assert dry[r]["figures"]["memory"] == real[r]["memory"], f"rank {r} memory"
        assert any(k[0].startswith("ep/") for k in real[r]["bytes"])  # the all-to-alls ran
    assert list(representatives(world)) == [0]
    for r in range(world):
        assert role_figures(real[r]) == role_figures(real[0]), f"rank {r} vs 0"


def test_exact_dispatch_is_refused_in_a_dry_run():
    with pytest.raises(ValueError, match="exact dispatch sends the routed rows"):
        dry_ep(cfg_of(), 2, 2, 4, 8, dispatch="exact")
