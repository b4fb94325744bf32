"""A training step of our models leaves the process's SDPA backend choice as it found it.

torch initializes its default SDPA priority order lazily (cuDNN first on sm90/sm100); a scoped
priority change entered before that first call used to restore the uninitialized flash-first order
(`kernels/attention_sdpa_cudnn_first.py`). Each case runs in a fresh process, because the state is
process-wide and this test process may have called SDPA already.
"""
import functools
import json
import subprocess
import sys

import pytest
import torch

from tests.limits import SUBPROCESS_TIMEOUT_S

pytestmark = pytest.mark.gpu

PROBE = r"""
import json, sys, torch
from torch.nn.attention import SDPBackend

def state():
    q = torch.randn(1, 32, 256, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 32, 256, 128, device="cuda", dtype=torch.bfloat16)
    choice = SDPBackend(torch._fused_sdp_choice(q, k, k, is_causal=True)).name
    return {"choice": choice, "order": list(torch._C._get_sdp_priority_order()),
            "enabled": [torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled(),
                        torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()]}

model_name, before_too, impl = sys.argv[1], sys.argv[2] == "1", json.loads(sys.argv[3])
out = {"before": state() if before_too else None}
if model_name != "none":
    import bumblebee as bb
    model = bb.models.build(model_name, impl, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, model.config.vocab_size, (2, 64), device="cuda")
    model(ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
out["after"] = state()
print("STATE" + json.dumps(out))
"""


# The SDPA state is the attention slot's concern; Qwen3.5's DeltaNet layers never call SDPA. On fla they
# autotune its Triton kernels afresh in each new process (shard 6 ran out of 230-350 s in this case), so they
# run the torch twin here.
IMPL = {"qwen3.5-tiny": {"linear_attention": "torch_chunked"}}


def _run(model: str, before_too: bool) -> dict:
    impl = json.dumps(IMPL.get(model))
    p = subprocess.run([sys.executable, "-c", PROBE, model, "1" if before_too else "0", impl],
                       capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("STATE"))
    return json.loads(line[5:])


@functools.cache
def _fresh() -> dict:
    """What a process that never ran our code picks: one process for every case."""
    return _run("none", False)["after"]


@pytest.mark.parametrize("model", ["qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny", "qwen3.5-tiny"])
def test_plain_sdpa_choice_unchanged_by_a_training_step(model):
    fresh = _fresh()
    first = _run(model, False)["after"]  # our step is the process's first SDPA user
    both = _run(model, True)  # a plain call before and after our step
    assert first == fresh, (first, fresh)
    assert both["before"] == both["after"] == fresh, both
    if torch.cuda.get_device_capability() in ((9, 0), (10, 0)):
        assert fresh["choice"] == "CUDNN_ATTENTION", fresh  # torch's own default on Hopper/Blackwell
