"""Probe: the chain pass's summary kernels of one part, fla 0.6's against ours (one GPU, no ranks).

At CP = 2 and 128K tokens a rank's profile (`probe_gdn_profile.py`, fla_concurrent) spent 13.2 ms in
`chunk_cp_fwd_kernel_h` and 15.2 ms in `chunk_cp_bwd_kernel_dh` (two calls each, one per 32K part)
of a 71 ms layer, against 0.8 ms a call for fla's plain state scan over as many chunks. fla's
summary writes [state columns | transition map M]; its M programs compose [K, K] x [K, K] in tf32x3.
Here, per part of `--tokens` (Qwen3.5's heads, 16 key / 32 value of 128, bf16, chunks of 64):
- fla: `chunk_cp_fwd_h` / `chunk_cp_bwd_dh` whole (state columns and M);
- fla_state_columns: fla's kernel over the state columns only (the grid our path launches);
- ours_fp32 / ours_bf16x2 / ours_bf16: `kernels/context_parallel_gdn_transition.py`'s M, forward and reverse;
- plain_state_scan: fla's `chunk_gated_delta_rule_fwd_h` over the same chunks (the scale);
each timed (median of `--iters` after warm-up), and M's relative difference from fla's M (which
keeps the chain in fp32). One JSON document: stamp, shapes, ms per kernel, differences.

    python benchmarks/context_parallel/probes/probe_cp_transition.py [--tokens 32768] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: stamp, timing
from stamp import stamp  # noqa: E402
from timing import median_ms  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the test suite's rows (benchmarks import references from tests)
from bumblebee.kernels.context_parallel_gdn_transition import PRECISIONS, transition_map  # noqa: E402
from tests.primitives.test_context_parallel_transition import local_cumsum, make  # noqa: E402


def inputs(T, H, HV, K, V, device, seed=0):
    """The transition test's rows (unit keys, delta-rule W, per-head decays from slow to fast: the map
    keeps its slow heads over a 32K part), plus the state columns' inputs."""
    k, w, step = make(T, H, HV, K, seed)
    gate = local_cumsum(step, 64, 0)
    g = torch.Generator().manual_seed(seed + 1)
    u, do = (torch.randn(1, T, HV, V, generator=g) * 0.1 for _ in range(2))
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=g), dim=-1)
    b = torch.bfloat16
    return {n: t.to(device, b if n != "g" else torch.float32)
            for n, t in dict(k=k, w=w, g=gate, u=u, q=q, do=do, dv=0.1 * do).items()}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32768, help="one part's tokens (a multiple of 64)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.cp.chunk_bwd import chunk_cp_bwd_dh, chunk_cp_bwd_kernel_dh
    from fla.ops.cp.chunk_fwd import chunk_cp_fwd_h, chunk_cp_fwd_kernel_h

    dev = torch.device("cuda")
    T, H, HV, K, V = args.tokens, 16, 32, 128, 128
    x = inputs(T, H, HV, K, V, dev)
    cu = torch.tensor([0, T], device=dev, dtype=torch.long)
    hm = {n: torch.zeros(HV, K, V + K, device=dev) for n in ("fla_fwd", "fla_bwd")}
    ours = {(p_, r): torch.zeros(HV, K, K, device=dev) for p_ in PRECISIONS for r in (False, True)}
    calls = {
        "fla_fwd": lambda: chunk_cp_fwd_h(k=x["k"], w=x["w"], u=x["u"], hm=hm["fla_fwd"], g=x["g"], cu_seqlens=cu),
        "fla_bwd": lambda: chunk_cp_bwd_dh(q=x["q"], k=x["k"], w=x["w"], do=x["do"], dv=x["dv"], dhm=hm["fla_bwd"],
                                           g=x["g"], scale=K ** -0.5, cu_seqlens=cu),
        "fla_state_columns_fwd": lambda: chunk_cp_fwd_kernel_h[(V // 64, HV)](
            k=x["k"], v=x["u"], w=x["w"], g=x["g"], gk=None, bg=None, u=x["u"], hm=hm["fla_fwd"], cu_seqlens=cu, T=T,
            H=H, HV=HV, K=K, V=V, BT=64, BV=64, BK=K, MULTI_SEQS=False),
        "fla_state_columns_bwd": lambda: chunk_cp_bwd_kernel_dh[(V // 64, HV)](
            q=x["q"], k=x["k"], w=x["w"], g=x["g"], gk=None, do=x["do"], dhm=hm["fla_bwd"], dv=x["dv"],
            cu_seqlens=cu, scale=K ** -0.5, T=T, H=H, HV=HV, K=K, V=V, BT=64, BV=64, BK=K, USE_BG=False),
        "plain_state_scan": lambda: chunk_gated_delta_rule_fwd_h(k=x["k"], w=x["w"], u=x["u"], g=x["g"],
                                                                 output_final_state=True),
    }
    for (prec, rev), out in ours.items():
        calls[f"ours_{prec}_{'bwd' if rev else 'fwd'}"] = (
            lambda prec=prec, rev=rev, out=out: transition_map(x["k"], x["w"], x["g"], cu, out, reverse=rev,
                                                               precision=prec))
    ms = {}
    for name, fn in calls.items():
        ms[name] = median_ms(fn, iters=args.iters, warmup=2)
        print(name, round(ms[name], 3), "ms", flush=True)
    calls["fla_fwd"]()
    calls["fla_bwd"]()  # M as fla's whole kernels leave it (the state-column runs rewrote only columns < V)
    diff = {f"ours_{p_}_{'bwd' if r else 'fwd'}": rel(m, hm["fla_bwd" if r else "fla_fwd"][:, :, V:])
            for (p_, r), m in ours.items()}
    result = {**stamp(dev), "probe": "cp_transition", "part_tokens": T, "heads": [H, HV, K, V], "chunk": 64,
              "iters": args.iters, "ms": ms, "m_rel_diff_from_fla": diff,
              "fla_m_norm": hm["fla_fwd"][:, :, V:].norm().item()}
    print(json.dumps({"ms": ms, "diff": diff}))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "probe_cp_transition.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
