"""verl's SFT trainer drives the engine (`engine=bumblebee` from the shipped Hydra entries): four
steps with a checkpoint after two through verl's CheckpointHandler, then a second trainer resumes
from it (engine state, LR schedule, dataloader position) and its two steps equal the first run's,
bitwise. The data is made here: a character-level tokenizer with a chat template saved beside the
tiny checkpoint, and a parquet file of two-turn conversations."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("verl")

from tests.e2e import verl_cases as vc  # noqa: E402
from tests.primitives.test_state_sharding import spawn  # noqa: E402

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STEPS, SAVE = 4, 2


def sft_data(out: Path) -> tuple[Path, Path]:
    """(the tiny checkpoint with a tokenizer, a parquet file of 16 conversations)."""
    import pandas as pd
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    path = vc.tiny_checkpoint(out)
    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + CHARS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   additional_special_tokens=specials[1:])
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    rows = [{"messages": [{"role": "user", "content": f"copy {i * 7919 % 1000:03d}"},
                          {"role": "assistant", "content": f"{i * 7919 % 1000:03d}"}]} for i in range(16)]
    data = out / "sft.parquet"
    pd.DataFrame(rows).to_parquet(data)
    return path, data


def sft_config(path: Path, data: Path, local_dir: Path, *overrides: str):
    import verl
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(str(Path(verl.__file__).parent / "trainer/config"), version_base=None):
        return compose("sft_trainer_engine", overrides=[
            "hydra.searchpath=[pkg://bumblebee.integrations.verl_config]", "engine=bumblebee",
            "engine.dtype=float32", f"model.path={path}", "model.enable_gradient_checkpointing=false",
            f"data.train_files={data}", "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2",
            "data.use_dynamic_bsz=false", "data.max_length=32", "data.num_workers=0",
            "optim.lr=1e-3", "optim.lr_warmup_steps=1", "optim.lr_scheduler_type=cosine",
            f"trainer.total_training_steps={STEPS}", f"trainer.save_freq={SAVE}", "trainer.device=cpu",
            "trainer.logger=[console]", f"trainer.default_local_dir={local_dir}", "trainer.total_epochs=1",
            *overrides])


def _fit(cfg) -> list:
    """SFTTrainer(cfg).fit(); the (loss, grad norm, lr) of each step, read from its TrainingWorker."""
    from verl.trainer.sft_trainer import SFTTrainer
    from verl.utils import tensordict_utils as tu
    trainer, steps = SFTTrainer(cfg), []
    train_batch = trainer.training_client.train_batch

    def recorded(data):
        out = train_batch(data)
        m = tu.get(out, "metrics")
        steps.append((m["loss"], m["grad_norm"], m["lr"]))
        return out
    trainer.training_client.train_batch = recorded
    trainer.fit()
    return steps


def sft_run(mesh, out):
    import os

    import torch.distributed as dist

    from tests.e2e import verl_cpu
    verl_cpu.use_cpu_platform()
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()), LOCAL_RANK="0")
    path, data = out / f"{vc.tiny_checkpoint(out).name}", out / "sft.parquet"
    first = _fit(sft_config(path, data, out / "first"))
    resumed = _fit(sft_config(path, data, out / "second", "trainer.resume_mode=resume_path",
                              f"trainer.resume_from_path={out / 'first' / f'global_step_{SAVE}'}"))
    return {"first": first, "resumed": resumed,
            "saved": sorted(p.name for p in (out / "first").glob("global_step_*"))}


def test_sft_trainer_resumes_bitwise(tmp_path):
    sft_data(tmp_path)
    res = spawn(1, "sft_run", tmp_path, module=__name__)[0]
    assert res["saved"] == [f"global_step_{SAVE}", f"global_step_{STEPS}"]
    assert len(res["first"]) == STEPS and len(res["resumed"]) == STEPS - SAVE
    assert res["resumed"] == res["first"][SAVE:]  # loss, grad norm and LR, to the last digit
    assert all(0 < s[0] < float("inf") and 0 < s[1] < float("inf") for s in res["first"])
    lrs = [s[2] for s in res["first"]]  # after each step: the one warm-up step done, then the cosine
    assert lrs[0] == 1e-3 and lrs == sorted(lrs, reverse=True) and lrs[-1] < lrs[0]
