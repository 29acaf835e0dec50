"""The report of an N-D dry run (`python -m emulator dryrun` without --cp): one row per
representative rank - its wall and CPU seconds, the memory ledger's peaks per category and the
bytes it sent per axis - each checked against parallel/nd_cost.py's closed forms for that rank
(the formulas the real-run tests hold parallel.train to), and the course's analytic figures for
the same layout beside them (planning/memory.py: the worst GPU, the published parameter count).
"""

from __future__ import annotations

import dataclasses

from parallel import nd_cost, nd_cost_cp_ep

GIB = 2**30
CATS = ("params", "grads", "optimizer", "activations")


def coords_of(layout, rank: int) -> dict:
    """Mesh coordinates of world rank ``rank`` (row-major dp, pp, cp, tp; with ep > 1 dp rank
    d = q ep + e sits at ep e, edp q: parallel/expert/nd.ep_mesh)."""
    t, c = rank % layout.tp, rank // layout.tp % layout.cp
    s, d = rank // (layout.cp * layout.tp) % layout.pp, rank // (layout.pp * layout.cp * layout.tp)
    out = {"dp": d, "pp": s, "cp": c, "tp": t}
    return out | ({"ep": d % layout.ep, "edp": d // layout.ep} if layout.ep > 1 else {})


def formulas(cfg, layout, B: int, S: int, rank: int) -> dict:
    """nd_cost's figures for world rank ``rank``: bytes per axis and memory peaks per category
    (ep > 1: nd_cost_cp_ep.ep_rank_bytes / ep_rank_memory; cp and ep activations:
    nd_cost_cp_ep.peak_activations)."""
    co = coords_of(layout, rank)
    s = co["pp"]
    if layout.ep > 1:
        axes, peak = (
            nd_cost_cp_ep.ep_rank_bytes(cfg, layout, B, S, co),
            nd_cost_cp_ep.ep_rank_memory(cfg, layout, s),
        )
    else:
        axes = nd_cost.rank_bytes(cfg, layout, B, S, co)
        peak = dict(nd_cost.rank_peak_memory(cfg, layout, s))
        peak["optimizer"] = nd_cost.rank_static_memory(cfg, layout, s)["optimizer"]
    if not (cfg.is_moe and layout.schedule == "zb-h1"):  # nd_cost has no MoE W-stash formula
        peak["activations"] = nd_cost_cp_ep.peak_activations(cfg, layout, B, S, co)
    return {"axes": axes, "peak": peak}


def differences(fig: dict, want: dict) -> list:
    """Where the dry run's figures differ from the formulas' (empty: equal)."""
    got = fig["run_memory"]["peak"]
    bad = [f"{a} bytes {fig['axes'].get(a, 0):,} != {n:,}" for a, n in want["axes"].items()
           if fig["axes"].get(a, 0) != n]  # fmt: skip
    bad += [f"{c} {got[c]:,} != {n:,}" for c, n in want["peak"].items() if got[c] != n]
    if "untagged" in fig["axes"]:  # traffic under no axis's tag: none in a correct run
        bad.append(f"untagged bytes {fig['axes']['untagged']:,}")
    return bad


def tags(fig: dict, depth: int = 2) -> dict:
    """Bytes sent per tag, cut to its first ``depth`` parts ("dp/grads", "tp/blocks.0")."""
    out: dict = {}
    for (tag, _op, _alg, direction, _peer, _group), n in fig["bytes"].items():
        if direction == "send":
            key = "/".join(tag.split("/")[:depth]) or "(untagged)"
            out[key] = out.get(key, 0) + n
    return out


def check_all(cfg, layout, B: int, S: int, runs: dict) -> dict:
    """{rank: differences from nd_cost} for every representative run."""
    return {r: differences(v["figures"], formulas(cfg, layout, B, S, r)) for r, v in runs.items()}


def shown_axes(layout) -> tuple:
    """The axes a report prints: dp, tp, pp, and cp / ep + edp when the layout has them."""
    return ("dp", "tp", "pp") + ("cp",) * (layout.cp > 1) + ("ep", "edp") * (layout.ep > 1)


def report(preset, layout, B, S, runs, checks, total, course, n_params, show_tags=False) -> str:
    """The text report; ``total`` a Timing of the whole run, ``course`` planning.memory's row,
    ``checks`` check_all's."""
    axes = shown_axes(layout)
    lines = [
        (
            f"dry run: {preset.name} as this model ({n_params / 1e9:.2f}B params; published "
            f"{preset.params / 1e9:.1f}B), seq={S}, {B // (layout.dp * layout.microbatches)} "
            f"sequence(s) per micro-batch, {layout.microbatches} micro-batch(es) per dp rank"
        ),
        f"layout : {layout}, through parallel.train (the N-D program)",
        (
            f"ran    : {len(runs)} representative rank(s) of {layout.world} in {total.wall:.1f} s wall, "
            f"{total.cpu:.1f} s CPU"
        ),
        "",
        f"{'rank':>6}  {'stands for':<28}{'wall s':>7}{'cpu s':>6}"
        + "".join(f"{c[:5]:>8}" for c in CATS)
        + "".join(f"{a + ' sent':>10}" for a in axes)
        + "   = nd_cost",
    ]
    units = " " * 47 + "(GiB per GPU: peaks per category)     (GiB sent, one step)"
    lines.insert(4, units)
    worst = {}
    bad_any = []
    for r, v in runs.items():
        fig, co = v["figures"], coords_of(layout, r)
        peak = fig["run_memory"]["peak"]
        bad = checks[r]
        bad_any += [f"rank {r}: {b}" for b in bad]
        for c in CATS:
            worst[c] = max(worst.get(c, 0), peak[c])
        who = f"stage {co['pp']}" + (f" cp {co['cp']}" if layout.cp > 1 else "")
        who += f", {layout.dp * layout.tp} rank(s)"
        lines.append(
            f"{r:>6}  {who:<28}{v['time'].wall:7.1f}{v['time'].cpu:6.1f}"
            + "".join(f"{peak[c] / GIB:8.2f}" for c in CATS)
            + "".join(f"{fig['axes'].get(a, 0) / GIB:10.2f}" for a in axes)
            + ("   equal" if not bad else "   DIFFERENT")
        )
        if show_tags:
            sent = tags(fig)
            for k in sorted(sent, key=sent.get, reverse=True)[:8]:
                lines.append(f"{'':>10}{k:<30}{sent[k]:>22,}")
    state = sum(worst[c] for c in ("params", "grads", "optimizer"))
    lines += [
        "",
        (
            f"worst GPU: state {state / GIB:.1f} GiB (course {course.state / GIB:.1f}), activations "
            f"{worst['activations'] / GIB:.1f} GiB (course {course.activ / GIB:.1f})"
        ),
        (
            "= nd_cost: this rank's bytes per axis and memory peaks equal parallel/nd_cost.py's "
            "closed forms; course: the analytic model at the published count (docs/planning.md)"
        ),
        (
            "stands for: every rank of a stage (and cp rank) holds the same shapes and sends the "
            "same bytes per tag (tests/planning/test_nd_dry_run.py, test_cp_ep_dry_run.py); "
            "dp/clip's few bytes depend on the ring position"
        ),
    ]
    if layout.ep > 1:
        lines.append(
            "routing: padded to capacity (the dry run's stated assumption): every micro-batch's "
            "routing group sends each expert its full capacity C = ceil(cf b S K / E) rows, filled "
            "or not, so no size depends on which tokens the router picks"
        )
    if layout.ep > 1 or layout.cp > 1:
        lines.append("course: the analytic model has no cp or ep term (dense, priced at the full "
                     "sequence on dp x tp x pp)")  # fmt: skip
    lines += [f"DIFFERENT {b}" for b in bad_any]
    return "\n".join(lines)


def as_json(layout, runs, checks, total, rss_mib) -> dict:
    return {"layout": dataclasses.asdict(layout), "driver": "parallel.train",
            "seconds": total.wall, "cpu_seconds": total.cpu, "peak_rss_mib": rss_mib,
            "ranks": {r: {"role": v["role"], "seconds": v["time"].wall,
                          "cpu_seconds": v["time"].cpu, "memory": v["figures"]["run_memory"],
                          "bytes_sent_by_axis": v["figures"]["axes"],
                          "bytes_sent_by_tag": tags(v["figures"]),
                          "differences_from_nd_cost": checks[r]}
                      for r, v in runs.items()}}  # fmt: skip
