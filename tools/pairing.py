"""The pairing harness: one model, one slot, two implementations, identical weights and batches.

Each side runs alone (the other is not resident), so peak memory and step time are its own. The
report says which code each side ran and, for a primitive whose kernels cannot run on the device,
that its torch path of their algorithm ran (never its twin's code); a pair whose two sides ran the
same code has status "same_code" (nothing was compared; the CLI exits with SAME_CODE_EXIT).
"""
from __future__ import annotations

import json
import statistics

import torch
from tqdm import tqdm

from bumblebee import registry
from bumblebee.probes import peak_memory, wall_ms

SAME_CODE_EXIT = 3  # the CLI's exit status when both sides ran the same code


def _batches(vocab: int, steps: int, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]


def _run(model, batches, device, lr, desc):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    records = []
    # disable=None: no bar unless stderr is a terminal (redirected, its line would run into the
    # report); on a terminal, leave=False erases it before the report is printed
    for ids in tqdm(batches, desc=desc, delay=3, leave=False, disable=None):
        ids = ids.to(device)
        with peak_memory(device, model, opt) as mem, wall_ms(device) as t:
            loss = model(ids, labels=ids).loss
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            opt.step()
            opt.zero_grad(set_to_none=True)
        records.append({"loss": loss.item(), "grad_norm": grad_norm.item(), "ms": t["ms"],
                        "peak": mem["peak_bytes"]})
    return records


def pair(model: str = "qwen3-tiny", slot: str = "attention", a: str = "sdpa", b: str = "eager", *,
         steps: int = 5, seed: int = 0, batch_size: int = 2, seq_len: int = 64, lr: float = 1e-3,
         warmup: int = 1, device=None, dtype=None, impl: dict | None = None) -> dict:
    """Train `model` with slot=a and slot=b from the same weights on the same batches; compare. `a`
    and `b` are any choice the registry takes: a name, "name:field=value,...", a config instance."""
    from bumblebee import models

    (impl_a, _), (impl_b, _) = registry.choose(slot, a), registry.choose(slot, b)  # ValueError listing what is accepted
    for name, value in (("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, int) or value < 1:  # an empty batch has no loss to compare
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    base = dict(impl or {})
    model_a = models.build(model, {**base, slot: a}, seed=seed, dtype=dtype, device="cpu")
    weights = {k: v.clone() for k, v in model_a.state_dict().items()}
    run_dtype = next(model_a.parameters()).dtype
    ran = {side: dict(zip(("code", "note"), registry.code_on(slot, name, device, run_dtype)))
           for side, name in (("a", a), ("b", b))}
    configs = {"a": model_a.impl_configs()}
    batches = _batches(model_a.config.vocab_size, steps, batch_size, seq_len, seed)
    torch.manual_seed(seed)
    rec_a = _run(model_a.to(device), batches, device, lr, f"{slot}={a}")
    del model_a
    model_b = models.build(model, {**base, slot: b}, seed=seed + 1, dtype=dtype, device="cpu")
    model_b.load_state_dict(weights)
    torch.manual_seed(seed)
    rec_b = _run(model_b.to(device), batches, device, lr, f"{slot}={b}")
    configs["b"] = model_b.impl_configs()
    # two configs of one implementation run different code (e.g. linear_ce's two paths), unless its
    # kernels did not run (both then ran its torch path)
    same = ran["a"]["code"] == ran["b"]["code"] and (
        ran["a"]["note"] or ran["b"]["note"] or configs["a"][slot] == configs["b"][slot])
    skipped = min(warmup, steps - 1)  # a single step is timed although it is the warm-up: the report says so
    return {
        "model": model, "slot": slot, "a": impl_a.name, "b": impl_b.name, "device": _device_name(device),
        "seed": seed, "options": {"a": registry.spec(slot, a), "b": registry.spec(slot, b)},
        # every slot of each side's model as it was resolved: implementation and options
        "configs": configs, "ran": ran, "status": "same_code" if same else "compared",
        "batch_size": batch_size, "seq_len": seq_len,
        "steps": [{"step": i, "loss_a": ra["loss"], "loss_b": rb["loss"],
                   "loss_abs_diff": abs(ra["loss"] - rb["loss"]),
                   "grad_norm_a": ra["grad_norm"], "grad_norm_b": rb["grad_norm"],
                   "grad_norm_rel_diff": abs(ra["grad_norm"] - rb["grad_norm"]) / max(abs(rb["grad_norm"]), 1e-30)}
                  for i, (ra, rb) in enumerate(zip(rec_a, rec_b))],
        # like the time, over the steps after warm-up: a first step's one-time allocations (kernel
        # autotuning, compilation) fall on whichever side runs first
        "peak_memory_bytes": {"a": max(r["peak"] for r in rec_a[skipped:]),
                              "b": max(r["peak"] for r in rec_b[skipped:])},
        "step_time_ms": {"a": statistics.median(r["ms"] for r in rec_a[skipped:]),
                         "b": statistics.median(r["ms"] for r in rec_b[skipped:])},
        "timed_steps": steps - skipped, "step_time_includes_warmup": skipped < warmup,
    }


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def format_report(r: dict) -> str:
    opts = r["options"]
    lines = [f"pair {r['model']}  slot={r['slot']}  a={opts['a']}  b={opts['b']}  device={r['device']}"]
    for side in "ab":
        code, note = r["ran"][side]["code"], r["ran"][side]["note"]
        lines.append(f"  {side}={opts[side]} ran " + ("its own code" if code == r[side] else f"{code}'s code")
                     + (f" ({note})" if note else ""))
    if r["status"] == "same_code":
        lines.append(f"SAME CODE: both sides ran {r['ran']['a']['code']}'s code on {r['device']}; the agreement "
                     f"below tests nothing (exit status {SAME_CODE_EXIT})")
    lines += [f"{'step':>4} {'loss_a':>12} {'loss_b':>12} {'|diff|':>10} {'gnorm_a':>11} {'gnorm_b':>11} {'rel diff':>10}"]
    for s in r["steps"]:
        lines.append(f"{s['step']:>4} {s['loss_a']:>12.6f} {s['loss_b']:>12.6f} {s['loss_abs_diff']:>10.2e} "
                     f"{s['grad_norm_a']:>11.5f} {s['grad_norm_b']:>11.5f} {s['grad_norm_rel_diff']:>10.2e}")
    mem, ms = r["peak_memory_bytes"], r["step_time_ms"]
    lines.append(f"peak memory MiB   a {mem['a'] / 2**20:10.2f}   b {mem['b'] / 2**20:10.2f}")
    if r["step_time_includes_warmup"]:
        what = "the warm-up step alone, not a steady-state time: run --steps 2 or more"
    else:
        n = r["timed_steps"]
        what = f"median of {n} step{'s' if n > 1 else ''}" + (" after warm-up" if n < len(r["steps"]) else "")
    lines.append(f"step time ms      a {ms['a']:10.2f}   b {ms['b']:10.2f}   ({what})")
    return "\n".join(lines)


def write_json(r: dict, path) -> None:
    with open(path, "w") as f:
        json.dump(r, f, indent=2)
