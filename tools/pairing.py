"""The pairing harness: one model, one slot, two implementations, identical weights and batches.

Each side runs alone (the other is not resident), so peak memory and step time are its own. Step
time is the median of the steps after `warmup`, each timed alone; peak memory is taken on one more
step after them (untimed, its loss not reported), since the CPU's memory tracker slows the step it
watches by an order of magnitude. The report says which code each side ran and, for a primitive
whose kernels cannot run on the device, that its torch path of their algorithm ran (never its
twin's code); a pair whose two sides ran the same code has status "same_code" (nothing was
compared; the CLI exits with SAME_CODE_EXIT).
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


def _step(model, opt, ids):
    loss = model(ids, labels=ids).loss
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, grad_norm


def _run(model, batches, device, lr, desc, warmup, on_step):
    """(per-step records, peak bytes): each step timed alone; the peak on one more, untimed step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    records = []
    # disable=None: no bar unless stderr is a terminal (redirected, its line would run into the
    # report); on a terminal, leave=False erases it before the report is printed. A caller that
    # prints each step (on_step) gets no bar: its lines are the progress
    for i, ids in enumerate(tqdm(batches, desc=desc, delay=3, leave=False, disable=True if on_step else None)):
        ids = ids.to(device)
        with wall_ms(device) as t:
            loss, grad_norm = _step(model, opt, ids)
        records.append({"loss": loss.item(), "grad_norm": grad_norm.item(), "ms": t["ms"], "warmup": i < warmup})
        if on_step is not None:
            on_step(i, records[-1])
    with peak_memory(device, model, opt) as mem:  # the steady state: moments exist, warm-up is over
        _step(model, opt, batches[-1].to(device))
    return records, mem["peak_bytes"]


def pair(model: str = "qwen3-tiny", slot: str = "attention", a: str = "sdpa", b: str = "eager", *,
         steps: int = 5, seed: int = 0, batch_size: int = 2, seq_len: int = 64, lr: float = 1e-3,
         warmup: int = 1, device=None, dtype=None, impl: dict | None = None, on_step=None) -> dict:
    """Train `model` with slot=a and slot=b from the same weights on the same batches; compare. `a`
    and `b` are any choice the registry takes: a name, "name:field=value,...", a config instance.
    The first `warmup` steps of each side are left out of its step time. `on_step(side, i, record)`,
    when given, is called as each step ends (record: loss, grad_norm, ms, warmup), and no bar is shown."""
    from bumblebee import models

    base = dict(impl or {})
    if slot in registry.slots():  # an unknown slot: `choose` below lists the known ones
        used = models.slots_used(model, base)
        if slot not in used:  # checked first: the default implementations may not be this slot's
            raise ValueError(f"slot {slot} is not used by model {model}; it uses: {', '.join(used)}")
    (impl_a, _), (impl_b, _) = registry.choose(slot, a), registry.choose(slot, b)  # ValueError listing what is accepted
    for name, value in (("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, int) or value < 1:  # an empty batch has no loss to compare
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not (isinstance(warmup, int) and warmup >= 0):
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    device = _device(device)
    model_a = models.build(model, {**base, slot: a}, seed=seed, dtype=dtype, device="cpu")
    weights = {k: v.clone() for k, v in model_a.state_dict().items()}
    run_dtype = next(model_a.parameters()).dtype
    ran = {side: dict(zip(("code", "note"), registry.code_on(slot, name, device, run_dtype)))
           for side, name in (("a", a), ("b", b))}
    configs = {"a": model_a.impl_configs()}
    batches = _batches(model_a.config.vocab_size, steps, batch_size, seq_len, seed)
    skipped = min(warmup, steps - 1)  # a single step is timed although it is the warm-up: the report says so
    side_steps = {side: (lambda i, r, side=side: on_step(side, i, r)) if on_step else None for side in "ab"}
    torch.manual_seed(seed)
    rec_a, peak_a = _run(model_a.to(device), batches, device, lr, f"{slot}={a}", warmup, side_steps["a"])
    del model_a
    model_b = models.build(model, {**base, slot: b}, seed=seed + 1, dtype=dtype, device="cpu")
    model_b.load_state_dict(weights)
    torch.manual_seed(seed)
    rec_b, peak_b = _run(model_b.to(device), batches, device, lr, f"{slot}={b}", warmup, side_steps["b"])
    configs["b"] = model_b.impl_configs()
    # two configs of one implementation run different code (e.g. linear_ce's two paths), unless its
    # kernels did not run (both then ran its torch path)
    same = ran["a"]["code"] == ran["b"]["code"] and (
        ran["a"]["note"] or ran["b"]["note"] or configs["a"][slot] == configs["b"][slot])
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
        # on a step after the timed ones: a first step's one-time allocations (kernel autotuning,
        # compilation) fall on whichever side runs first, and the probe is kept out of the timing
        "peak_memory_bytes": {"a": peak_a, "b": peak_b},
        "step_time_ms": {"a": statistics.median(r["ms"] for r in rec_a[skipped:]),
                         "b": statistics.median(r["ms"] for r in rec_b[skipped:])},
        "warmup_steps": skipped, "timed_steps": steps - skipped, "step_time_includes_warmup": skipped < warmup,
    }


def _device(device) -> torch.device:
    """The device asked for (default: cuda where available, else cpu); ValueError when it cannot run here."""
    try:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA device; use cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA devices")
    return dev


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
        n, w = r["timed_steps"], r["warmup_steps"]
        what = f"median of {n} step{'s' if n > 1 else ''}" + (
            f" after {w} warm-up step{'s' if w > 1 else ''}" if w else "")
    lines.append(f"step time ms      a {ms['a']:10.2f}   b {ms['b']:10.2f}   ({what})")
    return "\n".join(lines)


def format_step(side: str, i: int, record: dict) -> str:
    """One line per step as it ends (the CLI prints them while the sides run)."""
    tag = "  (warm-up)" if record["warmup"] else ""
    return (f"{side} step {i:>3}  loss {record['loss']:.6f}  grad_norm {record['grad_norm']:.5f}  "
            f"{record['ms']:.2f} ms{tag}")


def write_json(r: dict, path) -> None:
    with open(path, "w") as f:
        json.dump(r, f, indent=2)
