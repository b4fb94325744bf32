"""Receiver layout inference at Qwen3-30B-A3B scale on the host: time and peak RSS (CPU only).

The receiver is the test suite's vLLM-style engine (stacked qkv_proj / gate_up_proj, column/row
TP splits, vocabulary padding, fused w13 / w2 experts) for Qwen3-30B-A3B's real shapes (48 layers,
128 experts, 18,867 HF tensors, 30.5 G elements, bf16) at TP 1, 2 and 4. Its parameters live
either on meta (`meta`: the trace needs no values; the check cannot run) or in host memory that
is allocated and never written (`host`: torch.empty; pages count in RSS only once written, so a
60 GB engine fits a small machine as long as inference touches little of it). Each case runs in
its own process (peak RSS is the process's `ru_maxrss`; `rss_before_gib` is what the process held
before inference: Python, torch, the manifest, the engine's bookkeeping). Times are wall and
process CPU seconds of one `infer_layout` call; CPU seconds are the steadier number on a shared
host.

Cases: `trace` (the default path: one traced loader call, one bitwise check of the
representatives) at 48 layers; the reference path (`probe`: value probes of every element, a
full check; `infer_layout(trace=False)`) only on a 1-layer slice with written targets, since at 48
layers its index tensors alone (8 bytes per target element, several times over) exceed host memory,
and `trace` on the same slice for the direct comparison.

    python benchmarks/weight_transfer/infer_scale.py --out benchmarks/weight_transfer/results
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: stamp
sys.path.insert(0, str(HERE))  # bench.py: meta_manifest
sys.path.insert(0, str(HERE.parent.parent))  # the test suite's engine layout (benchmarks import references from tests)

CASES = ([dict(path="trace", layers=48, tp=tp, params="host", verify=True) for tp in (1, 2, 4)]
         + [dict(path="trace", layers=48, tp=tp, params="meta", verify=False) for tp in (1, 2, 4)]
         + [dict(path=p, layers=1, tp=4, params="zeros", verify=True) for p in ("trace", "probe")])


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def one(case: dict) -> dict:
    """Build the engine and time one infer_layout call (in this process)."""
    from bench import meta_manifest
    from timing import host_seconds
    from bumblebee.primitives.weight_transfer import LayoutError, infer_layout
    from bumblebee.primitives.weight_transfer.infer import _ALLOWED, _representatives
    from bumblebee.primitives.weight_transfer.trace import Trace
    from tests.primitives.weight_transfer_engines import VllmStyleEngine

    class Engine(VllmStyleEngine):
        def _param(self, name, shape, loader):  # host memory never written: `empty`, not `zeros`
            if case["params"] != "host":
                return super()._param(name, shape, loader)
            if name not in self.params:
                p = torch.nn.Parameter(torch.empty(shape, dtype=self.dtype), requires_grad=False)
                p.weight_loader = loader
                self.params[name] = p

    hf, manifest = meta_manifest("qwen3-30b-a3b", case["layers"])
    eng = Engine(manifest, hf, tp_rank=case["tp"] - 1, tp_size=case["tp"], dtype=torch.bfloat16,
                 device="meta" if case["params"] == "meta" else "cpu")
    rss0 = _rss_gib()
    spec, wall, cpu = host_seconds(lambda: infer_layout(eng.load_weights, eng.params, manifest, verify=case["verify"],
                                                         trace=case["path"] == "trace"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out = {**case, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_rss_gib": round(peak, 2),
           "rss_before_gib": round(rss0, 2), "hf_tensors": len(manifest),
           "hf_elements": sum(int(torch.Size(s).numel()) for _, s, _ in manifest),
           "target_elements": sum(t.numel() for t in eng.params.values()), "pieces": len(spec.pieces)}
    if case["path"] == "trace":
        tr = Trace(eng.params, manifest, _ALLOWED, LayoutError).run(eng.load_weights)
        out.update(representatives=len(_representatives(tr)), value_probed=len(tr.impure))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="folder for infer-scale-cpu.json (printed only without it)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a case as JSON: run here, print its row
    ap.add_argument("--timeout-s", type=int, default=1800, help="the longest one case may take")
    ap.add_argument("--layers", type=int, help="run every case at this many layers (a quick check)")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return
    from stamp import stamp
    rows = []
    for case in CASES:
        case = {**case, "layers": args.layers or case["layers"]}
        try:
            proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(case)], capture_output=True,
                                  text=True, timeout=args.timeout_s)
            row = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {
                **case, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"rc {proc.returncode}"}
        except subprocess.TimeoutExpired:
            row = {**case, "error": f"not done within {args.timeout_s} s (wall)"}
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {**stamp("cpu"), "slot": "weight_transfer", "kind": "layout inference at scale",
              "model": "qwen3-30b-a3b", "receiver": "vLLM-style engine (tests/primitives/weight_transfer_engines.py)",
              "dtype": "bfloat16", "rows": rows}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "infer-scale-cpu.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
