"""Pictures as hand-written SVG (no plotting dependency): a timeline and a communication matrix.

`timeline_svg(events)`: one row per rank (a pipeline stage), one box per compute event
(emulator/trace.py `Event`: F, B, W), x = logical time under the replay's unit costs, with a
legend. `comm_matrix_svg(sent_to)`: for each axis (a group name up to its "[": "world", "dp",
"tp", "pp", ...) a P x P grid whose cell (i, j) is the bytes rank i sent to rank j in that axis's
groups, shaded by size, the number printed in the cell.

Every drawn element carries its numbers as data attributes (data-rank, data-start,
data-duration, data-src, data-dst, data-bytes), so a test can parse the file with xml.etree and
compare them with the events and the ledger.
"""

from __future__ import annotations

from xml.sax.saxutils import escape

from .trace import compute_events

COLORS = {"F": "#4e79a7", "B": "#f28e2b", "W": "#59a14f"}
NAMES = {"F": "F forward", "B": "B backward (input grad; + weight grad unless split)",
         "W": "W weight gradient (zero-bubble split)"}  # fmt: skip


def _svg(width: float, height: float, body: list[str]) -> str:
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="monospace" font-size="11">')  # fmt: skip
    return "\n".join([head, f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>',
                      *body, "</svg>"]) + "\n"  # fmt: skip


def _text(x, y, s, anchor="start", **attrs) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{extra}>{escape(str(s))}</text>'


def timeline_svg(events, n_ranks: int | None = None, title: str = "", unit_px: float = 28,
                 label: str = "stage") -> str:  # fmt: skip
    """The compute events as boxes on one row per rank; logical time (unit costs) on x."""
    ev = compute_events(events)
    if not ev:
        raise ValueError("timeline_svg: no compute events (F / B / W) to draw")
    n = n_ranks if n_ranks is not None else 1 + max(e.rank for e in ev)
    t0, t1 = min(e.start for e in ev), max(e.end for e in ev)
    left, top, row = 70, 40, 26
    width = left + float(t1 - t0) * unit_px + 20
    body = [_text(left, 18, title or "pipeline timeline", font_size=13)]
    for r in range(n):
        body.append(_text(left - 8, top + r * row + 17, f"{label} {r}", "end"))
    for e in ev:
        x = left + float(e.start - t0) * unit_px
        w = float(e.duration) * unit_px
        y = top + e.rank * row
        body.append(
            f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row - 4}" '
            f'fill="{COLORS.get(e.kind, "#999999")}" stroke="white" data-rank="{e.rank}" '
            f'data-kind="{escape(e.kind)}" data-start="{float(e.start)}" '
            f'data-duration="{float(e.duration)}"><title>{escape(e.name)}</title></rect>'
        )
        if w >= 18:
            body.append(_text(x + w / 2, y + 15, e.name, "middle", fill="white"))
    axis_y = top + n * row + 4
    body.append(f'<line x1="{left}" y1="{axis_y}" x2="{width - 20:.1f}" y2="{axis_y}" '
                'stroke="black"/>')  # fmt: skip
    span = t1 - t0
    step = max(1, round(float(span) / 12))
    for k in range(0, int(float(span)) + 1, step):
        x = left + k * unit_px
        body.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" '
                    'stroke="black"/>')  # fmt: skip
        body.append(_text(x, axis_y + 15, k, "middle"))
    body.append(_text(left, axis_y + 32, "logical time (unit costs: F = B = W = 1; not seconds)"))
    ly = axis_y + 50
    kinds = sorted({e.kind for e in ev}, key=lambda k: "FBW".find(k))
    for i, k in enumerate(kinds):
        body.append(f'<rect x="{left}" y="{ly + i * 16}" width="12" height="12" '
                    f'fill="{COLORS.get(k, "#999999")}" data-legend="{escape(k)}"/>')  # fmt: skip
        body.append(_text(left + 18, ly + i * 16 + 10, NAMES.get(k, k)))
    body.append(_text(left, ly + len(kinds) * 16 + 12, "idle: white gaps (the bubble)"))
    return _svg(max(width, 420), ly + len(kinds) * 16 + 24, body)


def axis_of(group: str) -> str:
    """The axis a group belongs to: its name up to the first '[' ("dp[0,2]" -> "dp")."""
    return group.split("[", 1)[0] or group


def comm_matrices(sent_to: list[dict]) -> dict[str, list[list[int]]]:
    """{axis: P x P bytes sent (row = sender, column = receiver, global ranks)} from every
    rank's {group: {peer: bytes}} (tools/run.py `rank_report`'s "sent_to", in rank order)."""
    P = len(sent_to)
    out: dict[str, list[list[int]]] = {}
    for src, groups in enumerate(sent_to):
        for group, peers in groups.items():
            m = out.setdefault(axis_of(group), [[0] * P for _ in range(P)])
            for dst, nbytes in peers.items():
                m[src][int(dst)] += int(nbytes)
    return out


def comm_matrix_svg(sent_to: list[dict], title: str = "") -> str:
    """One grid per axis: cell (i, j) = bytes rank i sent to rank j, darker = more."""
    mats = comm_matrices(sent_to)
    if not mats:
        raise ValueError("comm_matrix_svg: no message was sent; nothing to draw")
    P = len(sent_to)
    cell, left, gap = max(34, min(64, 480 // max(P, 1))), 60, 40
    body = [_text(10, 18, title or "bytes sent, row rank -> column rank, per axis", font_size=13)]
    x0, top = left, 50
    for axis, m in sorted(mats.items()):
        top_ = max((v for row in m for v in row), default=0) or 1
        body.append(_text(x0, top - 14, f"axis {axis}: {sum(map(sum, m)):,} B", font_size=12))
        for i in range(P):
            body.append(_text(x0 - 6, top + i * cell + cell / 2 + 4, f"{i}", "end"))
            body.append(_text(x0 + i * cell + cell / 2, top + P * cell + 14, f"{i}", "middle"))
            for j in range(P):
                v = m[i][j]
                shade = 255 - round(200 * v / top_)
                fill = f"rgb({shade},{shade},255)" if v else "#f4f4f4"
                body.append(
                    f'<rect x="{x0 + j * cell}" y="{top + i * cell}" width="{cell}" '
                    f'height="{cell}" fill="{fill}" stroke="#cccccc" data-axis="{escape(axis)}" '
                    f'data-src="{i}" data-dst="{j}" data-bytes="{v}"/>'
                )
                if v:
                    txt = f"{v / 1024:.0f}K" if v >= 10240 else str(v)
                    color = "white" if shade < 140 else "black"
                    body.append(_text(x0 + j * cell + cell / 2, top + i * cell + cell / 2 + 4,
                                      txt, "middle", fill=color, font_size=9))  # fmt: skip
        x0 += P * cell + gap + left // 2
    h = top + P * cell + 40
    body.append(_text(10, h - 6, "row: sending rank, column: receiving rank (global ranks)"))
    return _svg(x0, h, body)


def write(path: str, svg: str) -> str:
    with open(path, "w") as f:
        f.write(svg)
    return str(path)
