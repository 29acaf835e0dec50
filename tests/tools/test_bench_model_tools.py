"""`bench torch` skips with one line when torch is absent (CI has no torch); `bench model
--digest`'s fingerprint is a function of the results: equal for the recompute modes (bitwise
the same gradients by design), different for another seed's batch."""

import importlib.util

from benchmarks import model_digest, torch_peer_model
from emulator.model import ModelConfig


def test_bench_torch_without_torch_says_skipped(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "torch" else real(n, *a)
    )
    assert torch_peer_model.main(["--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("torch_peer_model: skipped - torch is not installed"), out


def test_digest_is_the_results_fingerprint(monkeypatch):
    cfg = ModelConfig(**model_digest.SMALL, dtype="float32")
    got = {rc: model_digest.step_digest(cfg, 2, rc) for rc in model_digest.RECOMPUTE}
    assert len(set(got.values())) == 1, got
    real = model_digest.synthetic_batch
    monkeypatch.setattr(model_digest, "synthetic_batch", lambda s, *a: real(s + 1, *a))
    assert model_digest.step_digest(cfg, 2, "none") != got["none"]
