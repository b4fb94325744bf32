"""Command line: `bumblebee list`, `bumblebee pair --model M --slot S --a X --b Y [--json PATH]`,
`bumblebee results [SLOT] [--file PATH] [--dir DIR] [--history]`, `bumblebee rl --config FILE`,
`bumblebee recipe MODEL --gpus N --seq-len T [--gpu h100|h200] [--cp N] [--json PATH]`.

Arguments are parsed before torch or any model code is imported (`--help` and refusals come at
once), so the help names the models and slots from the lists below; a test keeps them equal to
`bumblebee.models.NAMED` and the registry's slots."""
from __future__ import annotations

import argparse
import os
import sys

MODELS = ("qwen3-tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-moe-tiny", "qwen3-30b-a3b",
          "qwen3-235b-a22b", "deepseek-v3-tiny", "deepseek-v3", "qwen3.5-tiny", "qwen3.5-moe-tiny",
          "qwen3.5-hub-tiny", "qwen3.5-moe-hub-tiny", "qwen3.5-35b-a3b")
GPUS = ("h100", "h200")  # tools/recipe.py GPU_MEMORY's keys
SLOTS = ("attention", "cross_entropy", "linear_attention", "mla", "moe_dispatch", "mtp", "router", "state_sharding",
         "weight_transfer")


def _swap(text: str) -> tuple[str, str]:
    slot, eq, name = text.partition("=")
    if not (eq and slot and name):
        raise argparse.ArgumentTypeError(f"expected SLOT=IMPL (e.g. cross_entropy=linear_ce), got {text!r}")
    return slot, name


def _number(text: str, convert, ok, kind: str, bound: str):
    """An argparse type: `text` converted, refused unless ok(value), the message naming the bound."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind} {bound}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "an integer", ">= 1")


def _positive_float(text: str) -> float:
    return _number(text, float, lambda v: v > 0, "a number", "> 0")


def _fraction(text: str) -> float:
    return _number(text, float, lambda v: 0 <= v < 1, "a fraction", "in [0, 1)")


def _check_writable(path: str) -> str | None:
    """Why `path` cannot be written, or None: checked before a run, not after it (the file is
    opened for appending and, if it did not exist, removed again)."""
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    if not existed:
        os.remove(path)
    return None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each option's help (none for options without one); the epilog as written."""

    def _get_help_string(self, action):
        if action.default in (None, []):
            return action.help
        return super()._get_help_string(action)


PAIR_DESCRIPTION = """Train one model twice, from the same weights on the same batches, once with each
implementation of a slot; report per-step loss and grad-norm differences, and each side's peak
memory and step time."""

PAIR_EPILOG = """example:
  bumblebee pair --model qwen3-tiny --slot cross_entropy --a linear_ce --b materialized_ce --json r.json
  bumblebee pair --model qwen3-tiny --slot cross_entropy --a linear_ce:path=lean --b materialized_ce

exit status:
  0  the two sides were compared (read the differences: pair does not judge them)
  2  refused before running: an unknown name, a slot the model does not use, a bad argument, a
     device this machine lacks
  3  both sides ran the same code (one implementation twice, or two options of a primitive whose
     kernels cannot run on this device, both on its torch path), so nothing was compared; the
     report is still printed (and written)

skills/pairing/SKILL.md says how to read the report."""


RESULTS_DESCRIPTION = """Print the benchmark results of a slot, one compact table per result file (its scalar
columns; byte counts in GiB), each headed by the file's commit, dirty-tree flag, device, ranks and
versions ("commit unknown" for files written before results were stamped, with the commit that
recorded them). A slot's older runs are the lines of its results/history.jsonl, one table row each
(--history: each run's own tables). Without SLOT: every slot and its result files."""

RESULTS_EPILOG = """example:
  bumblebee results                      # the slots and their files
  bumblebee results training_step        # tokens/s, peak GiB, ratios against transformers + Liger
  bumblebee results --file benchmarks/training_step/results/training_step_qwen3-30b-a3b_h200_x1.json
  bumblebee results moe_dispatch --history   # and every older run of moe_dispatch/results/history.jsonl
  bumblebee results --stale              # which result files measure code changed since their commit"""


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="bumblebee", description=__doc__)
    sub = top.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="every slot, its implementations, their options and SKILL.md")
    p = sub.add_parser("pair", help="train one model with two implementations of a slot and compare",
                       formatter_class=_HelpFormatter, epilog=PAIR_EPILOG,
                       description=PAIR_DESCRIPTION)
    p.add_argument("--model", default="qwen3-tiny", metavar="NAME", help=f"a named model: {', '.join(MODELS)}")
    p.add_argument("--slot", default="attention",
                   help=f"the slot to pair: {', '.join(SLOTS)} (bumblebee list: their implementations)")
    p.add_argument("--a", default="sdpa", metavar="IMPL", help="the implementation of side a (usually the primitive): a name, or name:field=value,... "
                        "to set its options (bumblebee list: each one's options)")
    p.add_argument("--b", default="eager", metavar="IMPL", help="the implementation of side b (usually its twin), as --a")
    p.add_argument("--steps", type=_positive_int, default=5, metavar="N",
                   help="AdamW steps per side; the first is the warm-up, left out of the step time (the median of "
                        "the others); peak memory is measured on one more step, outside the timed ones")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the token batches")
    p.add_argument("--batch-size", type=_positive_int, default=2, metavar="B", help="sequences per batch")
    p.add_argument("--seq-len", type=_positive_int, default=64, metavar="T", help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (no weight decay)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda where available, else cpu)")
    p.add_argument("--swap", action="append", default=[], metavar="SLOT=IMPL", type=_swap,
                   help="set another slot alike on both sides, e.g. cross_entropy=linear_ce (repeatable)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the report as JSON to PATH (checked before the run)")
    r = sub.add_parser("results", help="the benchmark result files of a slot, as tables",
                       formatter_class=_HelpFormatter, epilog=RESULTS_EPILOG, description=RESULTS_DESCRIPTION)
    r.add_argument("slot", nargs="?", default=None, metavar="SLOT",
                   help="a slot or benchmark name (training_step, cross_entropy, ...); none: list them")
    r.add_argument("--file", default=None, metavar="PATH", help="print this one result file instead")
    r.add_argument("--dir", default=None, metavar="DIR",
                   help="the folder searched for result files (default: benchmarks/ of this checkout, its */results/)")
    r.add_argument("--history", action="store_true",
                   help="print each older run of a history.jsonl as its own tables (default: one row per run)")
    r.add_argument("--stale", action="store_true",
                   help="list each current result file and whether the code it measures changed since its commit "
                        "(git; with SLOT: that slot's files only)")
    rl = sub.add_parser("rl", help="an asynchronous RL run (GRPO on the pipeline) from a TOML or JSON config",
                        formatter_class=_HelpFormatter, epilog=RL_EPILOG,
                        description="Train from a typed config file: a progress line per step, a JSONL log "
                                    "and a plot of reward and idle fractions (skills/rl-pipeline/SKILL.md).")
    rl.add_argument("--config", required=True, metavar="FILE", help="the run's TOML or JSON file")
    rl.add_argument("--log", default=None, metavar="PATH", help="the JSONL log (overrides the file's log)")
    rl.add_argument("--plot", default=None, metavar="PATH",
                    help="the PNG of reward and idle fractions (overrides the file's; default: the log's name .png)")
    rc = sub.add_parser("recipe", help="the long-context recipe's layout (CP, EP, FSDP2, recompute) checked against "
                                       "the memory estimator", formatter_class=_HelpFormatter, epilog=RECIPE_EPILOG,
                        description=RECIPE_DESCRIPTION)
    rc.add_argument("model", metavar="MODEL", help=f"a named model ({', '.join(MODELS)}) or an HF config folder")
    rc.add_argument("--gpus", type=_positive_int, required=True, metavar="N", help="GPUs of the run")
    rc.add_argument("--seq-len", type=_positive_int, required=True, metavar="T", help="tokens a sequence")
    rc.add_argument("--gpu", default="h100", choices=GPUS, help="the GPU, for its memory")
    rc.add_argument("--gpu-memory", type=_positive_float, default=None, metavar="GIB",
                    help="GiB a GPU (instead of --gpu's)")
    rc.add_argument("--headroom", type=_fraction, default=0.1, metavar="F",
                    help="fraction of GPU memory left to the CUDA context, NCCL buffers and fragmentation")
    rc.add_argument("--cp", type=_positive_int, default=None, metavar="N",
                    help="check this CP size alone instead of choosing one")
    rc.add_argument("--ep", type=_positive_int, default=None, metavar="N",
                    help="this EP instead of the rule's (MoE models)")
    rc.add_argument("--tokens-per-gpu", type=_positive_int, default=32768, metavar="N",
                    help="the rule's most tokens of a sequence a GPU holds")
    rc.add_argument("--mixed-precision", default="bf16", choices=("bf16", "fp32"), help="compute dtype")
    rc.add_argument("--json", default=None, metavar="PATH", help="also write the recipe as JSON to PATH")
    return top


RECIPE_DESCRIPTION = """Choose the layout the long-context recipe prescribes for a model on N GPUs at one
sequence length: CP so that a GPU holds at most ~32K tokens of a sequence, EP for the MoE weights,
FSDP2 over every GPU, full recompute, linear cross-entropy; each candidate is checked with the memory
estimator (python -m bumblebee.tools.memory), and where the rule's does not fit, the ring exchange,
nothing kept through the recompute and other CP sizes are tried. Prints the candidates, the verdict
and the Python that builds the layout (skills/context-parallel/SKILL.md)."""

RECIPE_EPILOG = """example:
  bumblebee recipe qwen3.5-35b-a3b --gpus 16 --seq-len 131072 --gpu h100
  bumblebee recipe qwen3-30b-a3b --gpus 8 --seq-len 131072 --cp 2 --json r.json   # check CP = 2 alone

exit status:
  0  the recipe fits
  2  refused: an unknown model, a bad argument
  3  no layout fits (or the forced --cp does not): the longest length that fits is printed"""


RL_EPILOG = """example:
  bumblebee rl --config run.toml --log run.jsonl      # the file's format: runtime/pipeline/launch.py

exit status:
  0  the run finished
  2  the config was refused before running (an unknown key, a bad value)"""


def main(argv: list[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)
    if args.cmd in ("pair", "recipe") and args.json and (why := _check_writable(args.json)):
        top.error(f"--json {args.json}: cannot write there ({why})")

    if args.cmd == "results":
        from bumblebee.tools import results
        try:
            if args.stale:
                from bumblebee.tools import staleness
                rows = [r for r in staleness.report(args.dir) if args.slot in (None, r["slot"])]
                print(staleness.render(rows))
                return 0
            print(results.main(args.slot, file=args.file, directory=args.dir, history=args.history))
        except (ValueError, OSError) as e:
            print(f"bumblebee results: {e}", file=sys.stderr)
            return 2
        return 0
    if args.cmd == "recipe":
        return _recipe(args)
    if args.cmd == "rl":
        from bumblebee.runtime.pipeline.launch import launch
        return launch(args.config, log=args.log, plot_path=args.plot)
    if args.cmd == "list":
        from bumblebee import models, registry
        print(registry.describe())
        print()
        print(models.describe())
        return 0
    from bumblebee.tools.pairing import SAME_CODE_EXIT, format_report, format_step, pair, write_json

    def on_step(side, i, record):  # each line as its step ends, also when stdout is a file or a pipe
        print(format_step(side, i, record), flush=True)

    try:
        report = pair(args.model, args.slot, args.a, args.b, steps=args.steps, seed=args.seed,
                      batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, device=args.device,
                      impl=dict(args.swap), on_step=on_step)
    except ValueError as e:
        print(f"bumblebee pair: {e}", file=sys.stderr)
        return 2
    print()  # the report below the step lines
    print(format_report(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if report["status"] == "same_code":
        print(f"bumblebee pair: both sides ran {report['ran']['a']['code']}'s code on {report['device']}: "
              f"nothing was compared", file=sys.stderr)
        return SAME_CODE_EXIT
    return 0


def _recipe(args) -> int:
    import json

    from bumblebee.tools import recipe
    try:
        r = recipe.plan(args.model, gpus=args.gpus, seq_len=args.seq_len, gpu=args.gpu, gpu_memory_gib=args.gpu_memory,
                        headroom=args.headroom, cp=args.cp, ep=args.ep, max_tokens_per_gpu=args.tokens_per_gpu,
                        mixed_precision=args.mixed_precision)
    except ValueError as e:
        print(f"bumblebee recipe: {e}", file=sys.stderr)
        return 2
    print(r.table())
    if r.snippet():
        print()
        print(r.snippet())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r.to_dict(), f, indent=1)
        print(f"wrote {args.json}")
    return 0 if r.fits else 3


if __name__ == "__main__":
    sys.exit(main())
