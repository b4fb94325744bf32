"""DeepSeek-V3 against transformers (eager, fp32): logits for tiny configs (with and without
q_lora_rank, YaRN, groups, dense-first layers), loss and gradients, both save/load directions with
the published MTP checkpoint layout; MTP against a float64 reference; packed sequences; every slot
at its primitive against every slot at its twin."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

import bumblebee as bb
from bumblebee import registry
from bumblebee import hf_io
from bumblebee.primitives.mla import FlashMLA, FlashMLAConfig

transformers = pytest.importorskip("transformers")

CASES = {
    "q_lora_groups": dict(q_lora_rank=24, n_group=4, topk_group=2, first_k_dense_replace=1),
    "no_q_lora": dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8}),
    "dense2_nonorm_bias_plain_rope": dict(num_hidden_layers=4, first_k_dense_replace=2, norm_topk_prob=False,
                                          attention_bias=True, n_shared_experts=2, rope_interleave=False,
                                          hidden_size=40, vocab_size=331),
    "tied_top1": dict(tie_word_embeddings=True, num_experts_per_tok=1, n_group=2, topk_group=1),
}


def hf_model(seed, **overrides):
    kw = dict(vocab_size=257, hidden_size=48, intermediate_size=83, moe_intermediate_size=29, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12,
              qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
              n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
              max_position_embeddings=256, rms_norm_eps=1e-6, attn_implementation="eager",
              experts_implementation="eager")
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kw)).float().eval()
    with torch.no_grad():  # randomize norms, biases and the router so every piece is exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_save_our_load_logits_match(case, tmp_path):
    ref = hf_model(len(case), **CASES[case])
    ref.save_pretrained(tmp_path)
    ids = torch.randint(0, ref.config.vocab_size, (2, 37))
    with torch.no_grad():
        want = ref(ids).logits
    for mla in ("naive", "flash"):
        ours = bb.models.from_pretrained(tmp_path, impl={"mla": mla}, dtype=torch.float32)
        with torch.no_grad():
            got = ours(ids).logits
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-5, mla


def test_loss_and_gradients_match_transformers(tmp_path):
    ref = hf_model(3, num_mtp_layers=0).train()
    ref.save_pretrained(tmp_path)
    ours = bb.models.from_pretrained(tmp_path, dtype=torch.float32)
    assert not hasattr(ours, "mtp")
    ids = torch.randint(0, ref.config.vocab_size, (3, 19))
    labels = ids.clone()
    labels[0, :5] = -100
    want, got = ref(ids, labels=labels).loss, ours(ids, labels=labels).loss
    assert abs(got.item() - want.item()) < 1e-5 * want.item()
    want.backward()
    got.backward()
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():  # fused experts: transformers holds them fused too
        assert rel_err(p.grad, theirs[name].grad) < 1e-4, name


def test_transformers_checkpoint_without_mtp_weights(tmp_path):
    ref = hf_model(5)  # the config claims one MTP layer; transformers saves no MTP tensors
    ref.save_pretrained(tmp_path)
    ours = bb.models.from_pretrained(tmp_path, dtype=torch.float32)
    assert len(ours.mtp.layers) == 1
    assert torch.isfinite(ours.mtp.layers[0].eh_proj.weight).all()
    ids = torch.randint(0, ref.config.vocab_size, (2, 23))
    want = ref(ids, labels=ids).loss
    out = ours(ids, labels=ids)
    assert out.mtp_losses.shape == (1,)
    assert abs((out.loss - out.mtp_loss).item() - want.item()) < 1e-5 * want.item()
    assert out.mtp_loss.item() == pytest.approx(0.3 * out.mtp_losses[0].item(), rel=1e-6)


@pytest.mark.parametrize("shard", [False, True])
def test_our_save_published_layout_and_transformers_load(tmp_path, shard):
    ours = bb.models.build({**bb.models.NAMED["deepseek-v3-tiny"], "num_nextn_predict_layers": 2}, seed=5)
    with torch.no_grad():
        for name, b in ours.named_buffers():
            b.normal_(0.0, 0.1)
    ours.save_pretrained(tmp_path, max_shard_bytes=300_000 if shard else 2**30)
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    names = set(hf_io._weight_files(tmp_path))
    L = ours.config.num_hidden_layers
    for k in range(2):  # DeepSeek's published MTP layout at model.layers.{L + k}
        for key in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                    "shared_head.head.weight", "embed_tokens.weight", "self_attn.kv_b_proj.weight",
                    "mlp.experts.0.gate_proj.weight", "mlp.shared_experts.down_proj.weight",
                    "mlp.gate.e_score_correction_bias", "input_layernorm.weight"):
            assert f"model.layers.{L + k}.{key}" in names, key
    assert not any(n.startswith("mtp.") for n in names)
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                             experts_implementation="eager").float().eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 23))
    with torch.no_grad():
        assert rel_err(ours(ids).logits, ref(ids).logits) < 1e-5
    again = bb.models.from_pretrained(tmp_path)
    a, b = ours.state_dict(), again.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_partial_mtp_checkpoint_is_an_error(tmp_path):
    ours = bb.models.build("deepseek-v3-tiny", seed=1)
    state = ours.ours_to_hf_state(dict(ours.state_dict()))
    state.pop("model.layers.3.eh_proj.weight")
    hf_io.save_weights(state, ours.config.to_hf(), tmp_path)
    with pytest.raises(KeyError, match="lacks"):
        bb.models.from_pretrained(tmp_path)


# ---- MTP against a float64 reference of the formulation -------------------------------------------

def _mtp_reference(model, ids, labels, scale):
    """Written from the definition, in float64, on the model's own modules."""
    m = model.double()
    B, T = ids.shape
    pos = torch.arange(T).expand(B, T)
    cos, sin = m.model.rotary_emb(pos, torch.float64)
    h = m.model(ids, cos, sin)[0]  # final-normed hidden state
    emb = m.model.embed_tokens(ids)
    losses = []
    for k, layer in enumerate(m.mtp.layers, start=1):
        x = layer.eh_proj(torch.cat([layer.enorm(torch.roll(emb, -k, dims=1)), layer.hnorm(h)], dim=-1))
        h = layer.block(x, cos, sin)[0]
        logits = layer.shared_head["norm"](h) @ m.lm_head.weight.T
        total, count = 0.0, 0
        for b in range(B):
            for t in range(T - k - 1):
                y = labels[b, t + k + 1]
                if y != -100:
                    total = total - torch.log_softmax(logits[b, t], -1)[y]
                    count += 1
        losses.append(total / count)
    return scale / len(losses) * sum(losses), torch.stack(losses)


@pytest.mark.parametrize("mtp", ["lean", "materialized"])
def test_mtp_loss_matches_float64_reference(mtp):
    cfg = {**bb.models.NAMED["deepseek-v3-tiny"], "num_nextn_predict_layers": 2, "mtp_loss_scale": 0.1}
    ours = bb.models.build(cfg, impl={"mtp": mtp}, seed=3)
    ids = torch.randint(0, 1024, (2, 13))
    labels = ids.clone()
    labels[1, :4] = -100
    out = ours(ids, labels=labels)
    main = F.cross_entropy(ours(ids).logits[:, :-1].reshape(-1, 1024).double(), labels[:, 1:].reshape(-1))
    want_total, want_depths = _mtp_reference(ours, ids, labels, 0.1)
    assert rel_err(out.mtp_losses, want_depths) < 1e-5
    assert abs(out.mtp_loss.item() - want_total.item()) < 1e-5 * want_total.item()
    assert abs(out.loss.item() - (main + want_total).item()) < 1e-5 * out.loss.item()


def test_mtp_depth_beyond_sequence_is_an_error():
    ours = bb.models.build({**bb.models.NAMED["deepseek-v3-tiny"], "num_nextn_predict_layers": 2}, seed=0)
    ids = torch.randint(0, 1024, (1, 3))
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        ours(ids, labels=ids)
    with torch.no_grad():
        ours(ids)  # without labels no MTP runs


# ---- packed sequences ------------------------------------------------------------------------------

@pytest.mark.parametrize("mla", ["flash", "naive"])
def test_packed_sequences_equal_separate_forwards(mla):
    ours = bb.models.build("deepseek-v3-tiny", impl={"mla": mla}, seed=4)
    lengths = [5, 9, 3]
    seqs = [torch.randint(0, 1024, (1, n)) for n in lengths]
    packed = torch.cat(seqs, dim=1)
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    with torch.no_grad():
        got = ours(packed, cu_seqlens=cu).logits
        want = torch.cat([ours(s).logits for s in seqs], dim=1)
    assert rel_err(got, want) < 1e-5
    # the loss: no target crosses a sequence, the MTP depths included
    labels = packed.clone()
    loss = ours(packed, labels=labels, cu_seqlens=cu)
    sep = [ours(s, labels=s) for s in seqs]
    main = [F.cross_entropy(o.logits[0, :-1], s[0, 1:], reduction="sum") for o, s in
            zip([ours(s) for s in seqs], seqs)]
    assert abs((loss.loss - loss.mtp_loss).item() - (sum(main) / (17 - 3)).item()) < 1e-5
    counts = [n - 2 for n in lengths]  # depth 1: targets t + 2 inside each sequence
    want_mtp = sum(c * o.mtp_losses[0] for c, o in zip(counts, sep)) / sum(counts)
    assert abs(loss.mtp_losses[0].item() - want_mtp.item()) < 1e-5 * want_mtp.item()


@pytest.mark.parametrize("cu,match", [([0, 5, 16], "B\\*T=17"), ([0, 9, 5, 17], "strictly"), ([1, 17], "start at 0")])
def test_bad_cu_seqlens(cu, match):
    ours = bb.models.build("deepseek-v3-tiny", seed=0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ours(torch.randint(0, 1024, (1, 17)), cu_seqlens=torch.tensor(cu))


# ---- every slot at its primitive vs every slot at its twin -----------------------------------------

def test_all_primitives_vs_all_twins_same_loss_and_gradients():
    """Every slot the model uses at its primitive against every slot at its twin (one rank: the chunked
    dispatch against all_to_all), the MTP depths' blocks included."""
    prim = {"mla": "flash", "mtp": "lean", "cross_entropy": "linear_ce", "router": "aux_free",
            "moe_dispatch": "chunked"}
    twin = {slot: registry.get(slot, name).twin for slot, name in prim.items()}
    cfg = {**bb.models.NAMED["deepseek-v3-tiny"], "num_nextn_predict_layers": 2}
    a, b = bb.models.build(cfg, impl=prim, seed=6), bb.models.build(cfg, impl=twin, seed=6)
    assert set(a.slots_used()) == set(b.slots_used()) == set(prim)  # no slot left at a default on either side
    for model, impl in ((a, prim), (b, twin)):
        routers = bb.models.moe.routers(model)
        assert routers and all(r.route is registry.resolve("router", impl["router"]) for r in routers.values())
        dispatch = {m.dispatch for m in model.modules() if isinstance(m, bb.models.moe.MoEBlock)}
        assert dispatch == {registry.resolve("moe_dispatch", impl["moe_dispatch"])}, dispatch
    ids = torch.randint(0, 1024, (2, 21))
    la, lb = a(ids, labels=ids), b(ids, labels=ids)
    assert abs(la.loss.item() - lb.loss.item()) < 1e-5 * lb.loss.item()
    assert rel_err(la.mtp_losses, lb.mtp_losses) < 1e-5
    la.loss.backward()
    lb.loss.backward()
    gb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        assert rel_err(p.grad, gb[name].grad) < 1e-4, name


@pytest.mark.parametrize("lean", [True, False])
def test_full_recompute_same_loss_and_gradients(lean):
    cfg = {**bb.models.NAMED["deepseek-v3-tiny"], "num_nextn_predict_layers": 1}
    impl = {"mla": FlashMLAConfig(lean_backward=lean)}
    a, b = bb.models.build(cfg, impl, seed=8), bb.models.build(cfg, impl, seed=8).set_recompute(True)
    ids = torch.randint(0, 1024, (2, 15))
    cu = torch.tensor([0, 7, 30])
    la, lb = a(ids, labels=ids, cu_seqlens=cu), b(ids, labels=ids, cu_seqlens=cu)
    la.loss.backward()
    lb.loss.backward()
    assert la.loss.item() == pytest.approx(lb.loss.item(), rel=1e-6)
    gb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        assert rel_err(p.grad, gb[name].grad) < 1e-5, name


def test_mla_options_reach_every_layer_and_the_lean_backward_keeps_less():
    """`impl={"mla": "flash:lean_backward=..."}` configures every MLA layer, the MTP depth's too, and the
    model honours it: the lean layers keep fewer bytes for the backward, same loss."""
    cfg = {**bb.models.NAMED["deepseek-v3-tiny"], "num_nextn_predict_layers": 1}
    ids = torch.randint(0, 1024, (2, 33))
    kept, losses = {}, {}
    for lean in (True, False):
        model = bb.models.build(cfg, impl={"mla": f"flash:lean_backward={lean}"}, seed=3)
        layers = [m for m in model.modules() if isinstance(m, FlashMLA)]
        assert len(layers) == cfg["num_hidden_layers"] + 1
        assert all(m.options == FlashMLAConfig(lean_backward=lean) for m in layers)
        assert model.impl_configs()["mla"]["lean_backward"] is lean
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            losses[lean] = model(ids, labels=ids).loss
        kept[lean] = sum(n for ptr, n in seen.items() if ptr not in params)
    assert kept[True] < kept[False], kept
    assert abs(losses[True].item() - losses[False].item()) < 1e-5 * losses[False].item()


@pytest.mark.gpu
def test_bf16_gpu_primitives_vs_twins():
    cfg = {**bb.models.NAMED["deepseek-v3-tiny"], "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "num_nextn_predict_layers": 1}
    ref = bb.models.build(cfg, impl={"mla": "naive", "mtp": "materialized"}, seed=9, dtype=torch.float64, device="cuda")
    twin = bb.models.build(cfg, impl={"mla": "naive", "mtp": "materialized"}, seed=9, dtype=torch.bfloat16,
                           device="cuda")
    prim = bb.models.build(cfg, seed=9, dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 1024, (2, 257), device="cuda")
    with moe_replay(ref, ids) as routes:  # route every model like the float64 one: no expert flips
        losses = {}
        for name, m in (("ref", ref), ("twin", twin), ("prim", prim)):
            routes(m)
            losses[name] = m(ids, labels=ids).loss
            losses[name].backward()
    e_twin = abs(losses["twin"].item() - losses["ref"].item())
    e_prim = abs(losses["prim"].item() - losses["ref"].item())
    assert e_prim <= 2 * e_twin + 1e-2 * losses["ref"].item()


class moe_replay:
    """Record the float64 model's routes, replay them in the others (bf16 may flip near-ties)."""

    def __init__(self, ref, ids):
        from bumblebee.models import moe
        self.moe, self.stack = moe, contextlib.ExitStack()
        with moe.record_routes(ref) as recorded, torch.no_grad():
            ref(ids, labels=ids)
            self.routes = recorded()

    def __enter__(self):  # routes(m): m replays the recorded routes until the block ends
        return lambda m: self.stack.enter_context(self.moe.replay_routes(m, self.routes))

    def __exit__(self, *exc):
        self.stack.close()
        return False


def test_full_size_config_parameter_count():
    from bumblebee.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
    c = DeepseekV3Config.from_hf(bb.models.NAMED["deepseek-v3"])
    with torch.device("meta"):
        m = DeepseekV3ForCausalLM(c)
    n = sum(p.numel() for p in m.parameters())
    # 671B main + MTP; the published checkpoint also stores the shared embedding and head once more
    # for MTP, and FP8 scale tensors (about 0.04B): 684.53B in its safetensors
    assert abs(n + 2 * c.vocab_size * c.hidden_size - 684.49e9) < 0.01e9
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * 1.0 * __import__("math").log(40) + 1) ** 2)
