"""The three planners print a distributed-training course's published tables digit for digit.

tests/planning/data/*.txt are those tables as published (the course's Labs 1-4 and its worked
examples); each command's output must contain the table's lines, contiguous and in order.
"""

import contextlib
import io
import json

import pytest

from planning import cli

DATA = __import__("pathlib").Path(__file__).parent / "data"

CASES = {
    "memory_llama2-70b_gpus8": "memory --preset llama2-70b --gpus 8 --micro-batch 1",
    "memory_llama2-70b_gpus64_suggest6": "memory --preset llama2-70b --gpus 64 --suggest --top 6",
    "collective_gpus8_bw50_lat8": "collective --gpus 8 --bw 50 --latency 8",
    "collective_gpus8_bw300_lat5_bytes16384": "collective --gpus 8 --bw 300 --latency 5 "
    "--bytes 16384",
    "collective_gpus16_bw25_lat15_params7_step900": "collective --gpus 16 --bw 25 --latency 15 "
    "--params 7 --step-ms 900",
    "collective_layer_ratio_h8192_ga8": "collective --gpus 8 --bw 300 --latency 5 --layer-ratio "
    "--hidden 8192 --grad-accum 8",
    "bubble_stages8_mb8_sweep": "bubble --stages 8 --micro-batches 8 --sweep",
}


def run(argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv.split())
    return rc, out.getvalue(), err.getvalue()


def contains_block(out: list[str], block: list[str]) -> bool:
    n = len(block)
    return any(out[i : i + n] == block for i in range(len(out) - n + 1))


@pytest.mark.parametrize("name", sorted(CASES))
def test_seed_table(name):
    block = (DATA / f"{name}.txt").read_text().rstrip("\n").split("\n")
    rc, out, _ = run(CASES[name])
    assert rc == 0
    assert contains_block(out.split("\n"), block), f"{CASES[name]}:\n{out}"


def test_block_match_is_strict():
    # one digit changed in the expected table must fail the comparison
    block = (DATA / "memory_llama2-70b_gpus8.txt").read_text().rstrip("\n").split("\n")
    _, out, _ = run(CASES["memory_llama2-70b_gpus8"])
    bad = [line.replace("133.6", "133.7") for line in block]
    assert not contains_block(out.split("\n"), bad)


def test_seed_prose_figures():
    # figures the course quotes in its text rather than in a table
    _, out, _ = run("memory --preset llama2-70b --gpus 8 --recompute full")
    fits = {line[:30].strip(): line.split()[-1] for line in out.split("\n") if "dp=" in line}
    assert [fits[k] for k in sorted(fits)] == ["NO", "YES", "YES", "NO", "NO", "YES"]
    assert " 5.0 " in out  # "activations collapse from 485 GiB to 5 GiB"
    assert run("collective --gpus 8 --bw 300 --latency 5 --bytes 67108864")[1].split("\n")[-2] \
        .startswith("single message 64.00 MiB: 0.461 ms")  # fmt: skip
    assert "4.908 ms" in run("collective --gpus 8 --bw 25 --latency 15 --bytes 67108864")[1]
    assert "ratio  0.191" in run("collective --gpus 8 --bw 300 --latency 5 --layer-ratio")[1]
    out = run("bubble --stages 16 --micro-batches 16")[1]
    assert "= 51.6%" in out and "M >= 135" in out  # drill 5: 16/31; 0.9 x 15 / 0.1
    assert "M >= 133" in run("bubble --stages 8 --target-efficiency 0.95")[1]


@pytest.mark.parametrize(
    "argv, words",
    [
        ("memory --preset gpt4", ["unknown preset 'gpt4'", "llama2-70b", "llama3-405b"]),
        ("memory --preset llama2-70b --gpus 8 --tp 3", ["tp=3", "heads 64 and kv heads 8"]),
        ("memory --preset llama2-70b --gpus 6 --pp 3", ["pp=3", "80 layers"]),
        ("memory --preset llama2-70b --gpus 12 --tp 8", ["12 GPUs"]),
        ("memory --preset llama2-70b --gpus 2 --suggest", ["no layout of 2 GPUs fits"]),
        ("bubble --stages 0", ["--stages must be >= 1"]),
        ("bubble --target-efficiency 1", ["(0, 1)"]),
        ("collective --gpus 1", ["--gpus must be >= 2"]),
    ],
)
def test_bad_input_one_line(argv, words):
    rc, out, err = run(argv)
    assert rc == 2 and out == "" and err.count("\n") == 1
    for w in words:
        assert w in err, err


def test_json_and_explain():
    rows = json.loads(run("memory --preset llama2-70b --gpus 8 --json")[1])["rows"]
    assert [r["state_gib"] for r in rows] == [1043.1, 358.6, 244.5, 133.6, 130.4, 130.4]
    assert json.loads(run("bubble --json")[1])["needed_micro_batches"] == 63
    sizes = json.loads(run("collective --json")[1])["sizes"]
    assert [r["regime"][0] for r in sizes] == list("llbbbbb")
    for tool in ("memory", "collective", "bubble"):
        text = run(f"{tool} --explain")[1]
        assert "arXiv:" in text
    assert "presets" not in run("memory --list-presets")[2]
