"""Receivers for the weight-transfer tests: an inference engine's layout written the way vLLM's
model files write it, and transformers' own model.

`VllmStyleEngine` builds, for one (TP rank, EP rank), the parameters vLLM would hold for the HF
tensors of a manifest, with vLLM's loading code shape: a `stacked_params_mapping` (qkv_proj,
gate_up_proj, DeepSeek's fused_qkv_a_proj, Qwen3.5's in_proj_qkvz and in_proj_ba), an
`expert_params_mapping` into fused w13 / w2 experts (experts over EP ranks), column- and
row-parallel splits with a `weight_loader` per parameter, vocabulary padding, replicated KV heads
when TP exceeds them, and renamed modules (post_attention_layernorm -> pre_mlp_norm).
"""
from __future__ import annotations

import re

import torch

STACKED = [  # (fused param, HF member, shard id) as vLLM's stacked_params_mapping
    ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    ("fused_qkv_a_proj", "q_a_proj", 0), ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1),
    ("in_proj_qkvz", "in_proj_qkv", (0, 1, 2)), ("in_proj_qkvz", "in_proj_z", 3),
    ("in_proj_ba", "in_proj_b", 0), ("in_proj_ba", "in_proj_a", 1),
]
REPLICATED_STACKS = {"fused_qkv_a_proj"}
COLUMN = ("q_b_proj", "kv_b_proj", "A_log", "dt_bias")
ROW = ("o_proj", "down_proj", "out_proj")
VOCAB = ("embed_tokens", "lm_head")
RENAMES = (("post_attention_layernorm", "pre_mlp_norm"),)
PAD = 64


def _rename(name: str) -> str:
    for a, b in RENAMES:
        name = name.replace(a, b)
    return name


class VllmStyleEngine:
    def __init__(self, manifest, config: dict, *, tp_rank=0, tp_size=1, ep_rank=0, ep_size=1, dtype=torch.float32,
                 device="cpu"):
        self.tp, self.r, self.ep, self.er, self.device = tp_size, tp_rank, ep_size, ep_rank, device
        self.moe_tp, self.moe_r = (1, 0) if ep_size > 1 else (tp_size, tp_rank)
        self.cfg, self.dtype = config, dtype
        self.shapes = {n: tuple(s) for n, s, *_ in manifest}
        self.params: dict[str, torch.Tensor] = {}
        self.n_experts = config.get("num_experts") or config.get("n_routed_experts") or 0
        for name, shape in self.shapes.items():
            self._make(name, shape)

    # ---- parameters --------------------------------------------------------------------------
    def _param(self, name, shape, loader):
        if name not in self.params:
            p = torch.nn.Parameter(torch.zeros(shape, dtype=self.dtype, device=self.device), requires_grad=False)
            p.weight_loader = loader
            self.params[name] = p

    def _parts(self, fused_prefix, fused):
        """The HF sizes of each shard id of a fused param (in_proj_qkv holds three)."""
        if fused == "in_proj_qkvz":
            kd = self.cfg["linear_num_key_heads"] * self.cfg["linear_key_head_dim"]
            vd = self.cfg["linear_num_value_heads"] * self.cfg["linear_value_head_dim"]
            return [kd, kd, vd, vd]
        return [self.shapes[f"{fused_prefix}.{m}.weight"][0] for f, m, _ in STACKED if f == fused]

    def _make(self, name, shape):
        m = re.match(r"(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            prefix, E = m.group(1), self.n_experts
            local = E // self.ep
            inter = shape[0] if m.group(3) != "down_proj" else shape[1]
            i_loc = inter // self.moe_tp
            D = shape[1] if m.group(3) != "down_proj" else shape[0]
            self._param(f"{prefix}.experts.w13_weight", (local, 2 * i_loc, D), self._expert_loader)
            self._param(f"{prefix}.experts.w2_weight", (local, D, i_loc), self._expert_loader)
            return
        for fused, member, _ in STACKED:
            if name.endswith(f".{member}.weight"):
                prefix = name[: -len(f".{member}.weight")]
                parts = self._parts(prefix, fused)
                n = self.tp if fused not in REPLICATED_STACKS else 1
                rows = sum(self._local_rows(fused, i, p, n) for i, p in enumerate(parts))
                self._param(f"{prefix}.{fused}.weight", (rows, shape[1]), self._stacked_loader(fused, parts))
                return
        leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
        if leaf in VOCAB:
            per = -(-shape[0] // (PAD * self.tp)) * PAD
            self._param(_rename(name), (per,) + shape[1:], self._vocab_loader)
        elif leaf == "conv1d":
            parts = self._parts(None, "in_proj_qkvz")[:3]
            self._param(_rename(name), (sum(p // self.tp for p in parts), shape[2]), self._conv_loader(parts))
        elif leaf in COLUMN:
            self._param(_rename(name), (shape[0] // self.tp,) + shape[1:], self._column_loader)
        elif leaf in ROW and ".experts." not in name:
            self._param(_rename(name), (shape[0], shape[1] // self.tp), self._row_loader)
        else:
            self._param(_rename(name), shape, default_weight_loader)

    def _kv(self):
        heads, kv = self.cfg["num_attention_heads"], self.cfg["num_key_value_heads"]
        return heads, kv, max(1, self.tp // kv)

    def _local_rows(self, fused, i, part, n):
        if fused == "qkv_proj" and i > 0:
            heads, kv, replicas = self._kv()
            return part // kv * max(1, kv // self.tp)
        return part // n

    # ---- loaders (vLLM's weight_loader shapes) --------------------------------------------------
    def _stacked_loader(self, fused, parts):
        def load(param, w, shard_id):
            ids = shard_id if isinstance(shard_id, tuple) else (shard_id,)
            if fused == "qkv_proj":
                ids = ({"q": 0, "k": 1, "v": 2}[shard_id],)
            n, r = (1, 0) if fused in REPLICATED_STACKS else (self.tp, self.r)
            src = 0
            for i in ids:
                size = self._local_rows(fused, i, parts[i], n)
                off = sum(self._local_rows(fused, j, parts[j], n) for j in range(i))
                if fused == "qkv_proj" and i > 0:
                    start = (r // self._kv()[2]) * size
                else:
                    start = r * size
                param.data.narrow(0, off, size).copy_(w.narrow(0, src + start, size))
                src += parts[i]
        return load

    def _conv_loader(self, parts):
        def load(param, w):
            w = w.squeeze(1)
            off = src = 0
            for p in parts:
                size = p // self.tp
                param.data.narrow(0, off, size).copy_(w.narrow(0, src + self.r * size, size))
                off, src = off + size, src + p
        return load

    def _vocab_loader(self, param, w):
        per = param.shape[0]
        start = self.r * per
        n = max(0, min(w.shape[0], start + per) - start)
        param.data[:n].copy_(w[start:start + n])

    def _column_loader(self, param, w):
        size = param.shape[0]
        param.data.copy_(w.narrow(0, self.r * size, size))

    def _row_loader(self, param, w):
        size = param.shape[1]
        param.data.copy_(w.narrow(1, self.r * size, size))

    def _expert_loader(self, param, w, expert, shard):
        local = expert - self.er * param.shape[0]
        if not 0 <= local < param.shape[0]:
            return  # another EP rank's expert
        if shard in ("w1", "w3"):
            size = param.shape[1] // 2
            dst = param.data[local].narrow(0, 0 if shard == "w1" else size, size)
            dst.copy_(w.narrow(0, self.moe_r * size, size))
        else:
            size = param.shape[2]
            param.data[local].copy_(w.narrow(1, self.moe_r * size, size))

    # ---- vLLM's load_weights -----------------------------------------------------------------------
    def expert_params_mapping(self):
        out = []
        for e in range(self.n_experts):
            for hf, shard in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                param = "experts.w13_" if shard != "w2" else "experts.w2_"
                out.append((param, f"experts.{e}.{hf}.", e, shard))
        return out

    @torch.no_grad()
    def load_weights(self, weights):
        params = self.params
        if not hasattr(self, "_experts"):  # built once: the twin calls load_weights once per tensor
            self._experts = self.expert_params_mapping()
        experts = self._experts
        for name, w in weights:
            for fused, member, shard_id in STACKED:
                if f".{member}." not in name or ".experts." in name:
                    continue
                target = name.replace(f".{member}.", f".{fused}.")
                if target not in params:
                    continue
                p = params[target]
                p.weight_loader(p, w, shard_id)
                break
            else:
                for param_name, weight_name, expert, shard in experts:
                    if weight_name not in name:
                        continue
                    p = params[name.replace(weight_name, param_name)]
                    p.weight_loader(p, w, expert, shard)
                    break
                else:
                    p = params[_rename(name)]
                    p.weight_loader(p, w)
        return set(params)


def default_weight_loader(param, w):
    param.data.copy_(w)


class HFReceiver:
    """transformers' own model as a receiver: HF names, no split; its loader is `load_state_dict`."""

    def __init__(self, model):
        self.model = model
        self.params = dict(model.named_parameters())

    @torch.no_grad()
    def load_weights(self, weights):
        self.model.load_state_dict(dict(weights), strict=False)


def vllm_spec(manifest, config: dict, *, tp_rank=0, tp_size=1, ep_rank=0, ep_size=1, dtype=torch.float32):
    """The `ReceiverSpec` of `VllmStyleEngine`, written by hand from its rules (no probe, no tensor:
    the engine is built on the meta device), for Qwen3 / Qwen3-MoE / DeepSeek-V3 layouts (not
    Qwen3.5's in_proj_qkvz or conv1d)."""
    from bumblebee.primitives.weight_transfer.spec import Piece, ReceiverSpec, dtype_name
    eng = VllmStyleEngine(manifest, config, tp_rank=tp_rank, tp_size=tp_size, ep_rank=ep_rank, ep_size=ep_size,
                          dtype=dtype, device="meta")
    P = eng.params
    pieces = []

    def add(hf, box, target, offset=0):
        pieces.append(Piece(hf, tuple(box), target, tuple(P[target].stride()[-len(box):]), offset))
    for name, shape, _ in manifest:
        full = [(0, 1, n) for n in shape]
        m = re.match(r"(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            w13, w2 = f"{m.group(1)}.experts.w13_weight", f"{m.group(1)}.experts.w2_weight"
            local = int(m.group(2)) - eng.er * P[w13].shape[0]
            if not 0 <= local < P[w13].shape[0]:
                continue
            i_loc = P[w2].shape[2]
            if m.group(3) == "down_proj":
                add(name, [full[0], (eng.moe_r * i_loc, 1, i_loc)], w2, local * P[w2].stride(0))
            else:
                half = m.group(3) == "up_proj"
                add(name, [(eng.moe_r * i_loc, 1, i_loc), full[1]], w13, local * P[w13].stride(0) + half * i_loc * shape[1])
            continue
        fused = next(((f, sid) for f, mem, sid in STACKED if name.endswith(f".{mem}.weight")), None)
        if fused:
            f, sid = fused
            prefix = name[: -len(name.split(".")[-2]) - len(".weight") - 1]
            if f == "in_proj_qkvz":
                raise NotImplementedError("in_proj_qkvz")
            target, parts = f"{prefix}.{f}.weight", eng._parts(prefix, f)
            i = {"q": 0, "k": 1, "v": 2}.get(sid, sid)
            n, r = (1, 0) if f in REPLICATED_STACKS else (eng.tp, eng.r)
            size = eng._local_rows(f, i, parts[i], n)
            start = (r // eng._kv()[2]) * size if f == "qkv_proj" and i > 0 else r * size
            off = sum(eng._local_rows(f, j, parts[j], n) for j in range(i)) * shape[1]
            add(name, [(start, 1, size), full[1]], target, off)
            continue
        leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
        target = _rename(name)
        if leaf in VOCAB:
            per = P[target].shape[0]
            add(name, [(eng.r * per, 1, max(0, min(shape[0], eng.r * per + per) - eng.r * per)), full[1]], target)
        elif leaf in COLUMN:
            size = P[target].shape[0]
            add(name, [(eng.r * size, 1, size)] + full[1:], target)
        elif leaf in ROW and ".experts." not in name:
            size = P[target].shape[1]
            add(name, [full[0], (eng.r * size, 1, size)], target)
        elif leaf == "conv1d":
            raise NotImplementedError("conv1d")
        else:
            add(name, full, target)
    targets = tuple((n, tuple(t.shape), tuple(t.stride()), dtype_name(t.dtype)) for n, t in P.items())
    return ReceiverSpec(tuple(manifest), targets, tuple(pieces)), eng
