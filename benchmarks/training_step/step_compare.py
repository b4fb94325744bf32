"""Ours against the peer in `training_step/bench.py`'s rows: which peer row pairs with ours, the speed
ratio with its spread over the interleaved rounds, and whether a target ratio is shown.

Pairing: only peer rows whose profiled step ran fused AdamW (the peer at its best; the reference stack's
foreach rows are never paired). Among those, a peer stack whose rows launched the same attention kernel
family as ours; where none did, the default peer, and the entry says so (`same_attention_kernel: false`)
and names both families.

Spread: each (stack, length) ran `rounds` times interleaved (peer, ours, peer, ours, ...), one median
step time per round. The ratio is the peer's median of round medians over ours'; its spread runs from
the peer's fastest round over our slowest (low) to the peer's slowest round over our fastest (high). A target is "shown" when even the low end reaches it,
"missed" when even the high end stays under it, and "not shown" otherwise (the margin lies inside the
spread), as it is with a single round.
"""
from __future__ import annotations

import statistics

TARGET = 1.3
DEFAULT_PEER = "transformers+liger"


def ours(stack: str) -> bool:
    return stack.split(":")[0] == "bumblebee"


def _family(rows: list[dict]) -> str | None:
    fams = {r.get("attention_kernel") for r in rows}
    return fams.pop() if len(fams) == 1 else None  # rounds disagreeing: no family


def _groups(rows: list[dict]) -> dict:
    by: dict = {}
    for r in rows:
        if r.get("fits") and not r.get("longest_probe"):
            by.setdefault((r["stack"], r["seq_len"]), []).append(r)
    return by


def verdict(low: float, high: float, target: float) -> str:
    if low >= target:
        return "shown"
    if high < target:
        return "missed"
    return "not shown"


def pair(mine: list[dict], theirs: list[dict], target: float) -> dict:
    """One comparison entry from our rows and the peer's at one length (one row per round each)."""
    m = [r["median_ms"] for r in mine]
    t = [r["median_ms"] for r in theirs]
    ratio = statistics.median(t) / statistics.median(m)
    low, high = min(t) / max(m), max(t) / min(m)
    first_m = min(mine, key=lambda r: r.get("round", 0))
    first_t = min(theirs, key=lambda r: r.get("round", 0))
    n = min(len(first_m["losses"]), len(first_t["losses"]))
    dl = [abs(a - b) / abs(b) for a, b in zip(first_m["losses"][:n], first_t["losses"][:n])]
    dg = [abs(a - b) / abs(b) for a, b in zip(first_m["grad_norms"][:n], first_t["grad_norms"][:n])]
    peak_m, peak_t = max(r["peak_bytes"] for r in mine), max(r["peak_bytes"] for r in theirs)
    fam_m, fam_t = _family(mine), _family(theirs)
    return {"seq_len": first_m["seq_len"], "ours": first_m["stack"], "peer": first_t["stack"],
            "rounds": min(len(m), len(t)), "ours_ms": m, "peer_ms": t,
            "speed_ratio": ratio, "speed_ratio_low": low, "speed_ratio_high": high,
            "spread": high - low, "target": target, "target_verdict": verdict(low, high, target),
            "peak_ratio": peak_m / max(1, peak_t), "peak_at_most_peer": peak_m <= peak_t,
            "static_ratio": first_m["static_bytes"] / max(1, first_t["static_bytes"]),
            "attention_kernel": {"ours": fam_m, "peer": fam_t}, "same_attention_kernel": fam_m == fam_t,
            "optimizer": {"ours": first_m.get("optimizer"), "peer": first_t.get("optimizer")},
            "steps_compared": n, "max_loss_rel_diff": max(dl), "max_grad_norm_rel_diff": max(dg),
            "loss_agrees": max(dl) <= 1e-2, "grad_norm_agrees": max(dg) <= 5e-2}


def compare(rows: list[dict], target: float = TARGET) -> list[dict]:
    """One entry per (our stack, length) with a fused-AdamW peer beside it; see the module docstring."""
    by = _groups(rows)
    out = []
    for (stack, s), mine in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if not ours(stack):
            continue
        peers = {st: rs for (st, ls), rs in by.items() if ls == s and not ours(st)
                 and all(r.get("optimizer") == "fused" for r in rs)}
        same = [st for st, rs in peers.items() if _family(rs) is not None and _family(rs) == _family(mine)]
        chosen = (DEFAULT_PEER if DEFAULT_PEER in same else same[0]) if same else (
            DEFAULT_PEER if DEFAULT_PEER in peers else next(iter(peers), None))
        if chosen is not None:
            out.append(pair(mine, peers[chosen], target))
    return out
