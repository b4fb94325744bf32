"""The producers' inference engine, behind a small adapter: `load_weights(named tensors, version)`,
`generate(prompt, n, sampling, seed=, refresh=)` -> Completions, and `version`. This is the seam a
vLLM or SGLang adapter implements; the shipped one runs transformers' `generate` (CPU or GPU) on the
weights the trainer exports (`Runtime.export_weights`: HF names and layout)."""
from __future__ import annotations

import itertools
import re
from typing import Callable, Iterable, Protocol

import torch

from bumblebee.runtime.pipeline.config import Sampling
from bumblebee.runtime.pipeline.samples import Completion, Group


class EngineAdapter(Protocol):
    version: int  # the weights version loaded (-1 before any)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def generate(self, prompts: list[list[int]], n: int, sampling: Sampling, *, seed: int,
                 refresh: Callable[[], None] | None = None) -> list[list[Completion]]:
        """`n` completions of each prompt; `refresh()` may load newer weights between tokens."""


_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")  # an expert's tensor, HF checkpoint name


class TransformersEngine:
    """transformers' `generate` on a model built from an HF config dict (`model_type` plus the
    config's fields, as `bumblebee.models.NAMED` holds them), weights from the trainer's export.
    Prompts of one call are left-padded into one batch. Sampling's `chunk_tokens` cuts a generation into calls of that many tokens; `refresh` runs
    between them (the producer loads newer weights there), and each token records the version that
    sampled it. The sampler's log-probs are those of the processed scores (temperature, top-k/p):
    the distribution the token was drawn from."""

    def __init__(self, hf_config: dict, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 eos_token_id: int | None = None, pad_token_id: int = 0):
        from transformers import AutoConfig, AutoModelForCausalLM
        cfg = {k: v for k, v in hf_config.items() if k not in ("model_type", "dtype")}
        if "model_type" not in hf_config:
            raise ValueError("hf_config needs its model_type (e.g. 'qwen3')")
        config = AutoConfig.for_model(hf_config["model_type"], **cfg)
        self.model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
        self.model.generation_config.eos_token_id = eos_token_id
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.device, self.eos, self.pad = torch.device(device), eos_token_id, pad_token_id
        self.version = -1

    def load_weights(self, weights, version: int) -> None:
        got, fused = self._load(weights)
        missing = [k for k in got.missing_keys if not (self.tied and k == "lm_head.weight") and k not in fused]
        missing += sorted(k for k, n in fused.items() if n != self._pieces(k))
        if got.unexpected_keys or missing:
            raise ValueError(f"weights do not match the engine's model: unexpected {got.unexpected_keys[:4]}, "
                             f"missing {missing[:4]}")
        if self.tied:
            self.model.tie_weights()
        self.version = version

    def weight_targets(self):
        """(loader, {name: parameter}) for a transfer that writes the engine's parameters in place
        (the weight-transfer primitive infers its layout from the loader)."""
        def load(weights):
            self._load(weights)
        return load, dict(self.model.named_parameters())

    @torch.no_grad()
    def _load(self, weights):
        """Load HF-checkpoint-named tensors; (load_state_dict's result for the rest, {stack: pieces
        written}). transformers 5 holds an MoE layer's experts as two stacks, `gate_up_proj` [E, 2I, H]
        (each expert's gate rows, then its up rows) and `down_proj` [E, H, I], where the checkpoint
        (and our export) has one tensor per expert and projection: those are copied into their
        slice of the stack, in place."""
        params, rest, fused = dict(self.model.named_parameters()), {}, {}
        for name, t in weights:
            m = _EXPERT.fullmatch(name)
            stack = m and f"{m[1]}.{'down_proj' if m[3] == 'down' else 'gate_up_proj'}"
            if not stack or stack not in params:
                rest[name] = t
                continue
            p, e = params[stack], int(m[2])
            half = p.shape[1] // 2
            {"gate": p[e, :half], "up": p[e, half:], "down": p[e]}[m[3]].copy_(t)
            fused[stack] = fused.get(stack, 0) + 1
        return self.model.load_state_dict(rest, strict=False), fused

    def _pieces(self, stack: str) -> int:
        """How many checkpoint tensors make up `stack`: two per expert for gate_up_proj, one for down_proj."""
        return dict(self.model.named_parameters())[stack].shape[0] * (2 if stack.endswith("gate_up_proj") else 1)

    @torch.no_grad()
    def generate(self, prompts, n, sampling: Sampling, *, seed: int, refresh=None) -> list[list[Completion]]:
        if self.version < 0:
            raise RuntimeError("generate before load_weights: the engine has no weights yet")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        width = max(len(p) for p in prompts)
        rows = [list(p) for p in prompts for _ in range(n)]
        ids = torch.tensor([[self.pad] * (width - len(r)) + r for r in rows], dtype=torch.long, device=self.device)
        attn = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long, device=self.device)
        out = [Completion([], [], []) for _ in rows]
        done = [False] * len(rows)
        left = sampling.max_new_tokens
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the sampler's RNG, seeded per call; the caller's is kept
            torch.manual_seed(seed)
            while left > 0 and not all(done):
                if refresh is not None and left < sampling.max_new_tokens:
                    refresh()
                k = min(sampling.chunk_tokens or left, left)
                gen = self.model.generate(ids, attention_mask=attn, do_sample=True, temperature=sampling.temperature,
                                          top_k=sampling.top_k, top_p=sampling.top_p, max_new_tokens=k,
                                          pad_token_id=self.pad, output_scores=True, return_dict_in_generate=True)
                new = gen.sequences[:, ids.shape[1]:]
                for j, scores in enumerate(gen.scores):
                    lp = torch.log_softmax(scores.float(), -1).gather(1, new[:, j:j + 1]).squeeze(1).tolist()
                    for i, c in enumerate(out):
                        if not done[i]:
                            t = int(new[i, j])
                            c.tokens.append(t)
                            c.logprobs.append(lp[i])
                            c.versions.append(self.version)
                            done[i] = t == self.eos
                # finished rows keep generating (ignored) so the batch stays one; their mask stays 1
                attn = torch.cat([attn, torch.ones_like(new)], 1)
                ids = gen.sequences
                left -= new.shape[1]
        return [out[i * n:(i + 1) * n] for i in range(len(prompts))]


def rollout(engine, task, leases, cfg, *, holder=0, refresh=None) -> list[Group]:
    """The groups of `leases` [(Lease, prompt, meta)]: `cfg.group_size` completions of each prompt in
    one engine call (seeded by the first lease's group, so a run is reproducible), scored by the
    task's rule."""
    comps = engine.generate([p for _, p, _ in leases], cfg.group_size, cfg.sampling,
                            seed=cfg.seed * 1_000_003 + leases[0][0].group, refresh=refresh)
    return [Group(lease.group, lease.ticket, list(prompt), cs, [float(task.reward(meta, c.tokens)) for c in cs],
                  producer=holder) for (lease, prompt, meta), cs in zip(leases, comps)]


def warmup_prompt(task, cfg) -> list[int]:
    """The prompt the trainer's warm-up step trains nothing on (`PipelineConfig.warmup`): the task's first."""
    return next(iter(task.prompts(cfg.seed)))[0]


def warm_engine(engine, task, cfg) -> None:
    """`PipelineConfig.warmup` on a producer: one throwaway engine call of `groups_per_call` prompts
    (nothing leased, scored or submitted; seed 0, apart from the run's seeds)."""
    prompts = [p for p, _ in itertools.islice(task.prompts(cfg.seed), cfg.groups_per_call)]
    engine.generate(prompts, cfg.group_size, cfg.sampling, seed=0)
