"""The training-step benchmark's harness on the CPU: our model loads transformers' own state dict of a
tiny Qwen3-MoE (and Qwen3.5-MoE) and trains it under FSDP2 with the same batches as transformers'
model under FSDP2, on one rank and on two; in fp32 the losses and grad norms agree to float32 rounding."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.limits import SUBPROCESS_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("model,ranks", [("qwen3-moe-tiny", 1), ("qwen3.5-moe-tiny", 1), ("qwen3-moe-tiny", 2)])
def test_both_stacks_train_the_same_model(tmp_path, model, ranks):
    """Two gloo ranks: ours with the experts over EP = 2 (chunked dispatch), the peer FSDP2 over both."""
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "training_step" / "bench.py"), "--cpu-smoke",
                        "--model", model, "--gpus", str(ranks), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(next(tmp_path.glob("training_step_*.json")).read_text())
    assert {r["stack"] for r in report["rows"]} == {"bumblebee", "transformers"}
    assert all(r["gpus"] == ranks for r in report["rows"])
    assert all(r["fits"] and len(r["losses"]) == 4 for r in report["rows"])
    (c,) = report["comparison"]
    assert c["steps_compared"] == 4
    assert c["max_loss_rel_diff"] < 1e-5 and c["max_grad_norm_rel_diff"] < 1e-4, c
