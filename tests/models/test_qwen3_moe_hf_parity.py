"""Qwen3-MoE against transformers: logits, loss + aux loss, per-expert and fused checkpoint layouts,
our save -> transformers load, and the MoE block's pieces (grouped GEMM, shared expert, replay)."""
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import bumblebee as bb
from bumblebee.models import moe

transformers = pytest.importorskip("transformers")

CASES = {
    "top2_norm": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "top3_nonorm_odd": dict(num_experts=5, num_experts_per_tok=3, norm_topk_prob=False, hidden_size=40,
                            moe_intermediate_size=19, head_dim=10, vocab_size=331),
    "sparse_step_mlp_only": dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3],
                                 num_experts=6, num_experts_per_tok=2, norm_topk_prob=True),
    "top1_tied": dict(num_experts=4, num_experts_per_tok=1, norm_topk_prob=True, tie_word_embeddings=True),
}


def hf_model(seed, **overrides):
    kw = dict(vocab_size=257, hidden_size=48, intermediate_size=83, moe_intermediate_size=29, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=256,
              num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6, attn_implementation="eager",
              experts_implementation="eager",
              router_aux_loss_coef=0.01)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kw)).float().eval()
    with torch.no_grad():  # randomize norms, and give the router logits a spread that routes unevenly
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_save_our_load_logits_match(case, tmp_path):
    ref = hf_model(len(case), **CASES[case])
    ref.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:  # transformers 5 saves per-expert keys
        assert any(".mlp.experts.0.gate_proj.weight" in k for k in f.keys())
    ours = bb.models.from_pretrained(tmp_path, impl={"attention": "eager"}, dtype=torch.float32)
    ids = torch.randint(0, ref.config.vocab_size, (2, 37))
    with torch.no_grad():
        want = ref(ids).logits
        got = ours(ids).logits
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-5


def test_loss_and_aux_loss_match_transformers(tmp_path):
    ref = hf_model(3, num_hidden_layers=3, mlp_only_layers=[1], num_experts=6, num_experts_per_tok=2)
    ref.save_pretrained(tmp_path)
    ids = torch.randint(0, ref.config.vocab_size, (3, 29))
    labels = ids.clone()
    labels[0, :7] = -100
    ours = bb.models.from_pretrained(tmp_path, dtype=torch.float32)
    want = ref(ids, labels=labels, output_router_logits=True)
    got = ours(ids, labels=labels, output_router_logits=True)
    assert len(got.router_logits) == 2
    assert abs(got.aux_loss.item() - want.aux_loss.item()) < 1e-5 * want.aux_loss.item()
    assert abs(got.loss.item() - want.loss.item()) < 1e-5 * want.loss.item()
    plain = ours(ids, labels=labels)  # the config's default: no router logits, no aux loss
    assert plain.aux_loss is None and plain.loss.item() != pytest.approx(got.loss.item(), abs=1e-9)


def test_gradients_match_transformers(tmp_path):
    ref = hf_model(7).train()
    ref.save_pretrained(tmp_path)
    ours = bb.models.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, ref.config.vocab_size, (2, 17))
    ref(ids, labels=ids, output_router_logits=True).loss.backward()
    ours(ids, labels=ids, output_router_logits=True).loss.backward()
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert rel_err(p.grad, theirs[name].grad) < 1e-4, name


def test_fused_checkpoint_layout_loads(tmp_path):
    ref = hf_model(11)
    ref.save_pretrained(tmp_path)  # for config.json
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state  # transformers' in-memory layout
    (tmp_path / "model.safetensors").unlink()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = bb.models.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, ref.config.vocab_size, (2, 13))
    with torch.no_grad():
        assert rel_err(ours(ids).logits, ref(ids).logits) < 1e-5


@pytest.mark.parametrize("shard", [False, True])
def test_our_save_transformers_load(tmp_path, shard):
    ours = bb.models.build("qwen3-moe-tiny", seed=5)
    ours.save_pretrained(tmp_path, max_shard_bytes=40_000 if shard else 2**30)
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    ref = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                         experts_implementation="eager").float().eval()
    assert ref.config.num_experts == ours.config.num_experts
    ids = torch.randint(0, ours.config.vocab_size, (2, 23))
    with torch.no_grad():
        assert rel_err(ours(ids).logits, ref(ids).logits) < 1e-5
    again = bb.models.from_pretrained(tmp_path)
    for (k, v), (k2, v2) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


def test_checkpoint_missing_an_expert_is_an_error(tmp_path):
    ours = bb.models.build("qwen3-moe-tiny", seed=1)
    state = moe.ours_to_hf_state(dict(ours.state_dict()))
    state.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    bb.hf_io.save_weights(state, ours.config.to_hf(), tmp_path)
    with pytest.raises(KeyError, match="lacks"):
        bb.models.from_pretrained(tmp_path)


# ---- the block's pieces ------------------------------------------------------------------------

def _block(**kw):
    torch.manual_seed(0)
    b = moe.MoEBlock(24, 20, 6, 2, **kw)
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(0, 0.3)
    return b


def test_grouped_mm_matches_expert_loop():
    b = _block()
    x = torch.randn(2, 9, 24, requires_grad=True)
    y_loop, _ = b(x)
    g_loop = torch.autograd.grad(y_loop.square().sum(), [x, b.experts.gate_up_proj, b.experts.down_proj])
    b.experts.grouped_mm = "always"
    y_gmm, _ = b(x)
    g_gmm = torch.autograd.grad(y_gmm.square().sum(), [x, b.experts.gate_up_proj, b.experts.down_proj])
    assert rel_err(y_gmm, y_loop) < 1e-5
    for a, c in zip(g_gmm, g_loop):
        assert rel_err(a, c) < 1e-5


def test_shared_expert_with_sigmoid_gate():
    b = _block(shared_hidden=16, shared_expert_gate=True)
    x = torch.randn(1, 7, 24)
    y, logits = b(x)
    x_ND = x.view(-1, 24)
    w, idx = bb.baselines.router.softmax_topk(logits, top_k=2, norm_topk_prob=True)
    routed = torch.zeros_like(x_ND)
    E = b.experts
    for n in range(7):
        for j in range(2):
            e = idx[n, j]
            g, u = (E.gate_up_proj[e] @ x_ND[n]).chunk(2)
            routed[n] += w[n, j] * (E.down_proj[e] @ (torch.nn.functional.silu(g) * u))
    shared = torch.sigmoid(b.shared_expert_gate(x_ND)) * b.shared_expert(x_ND)
    assert rel_err(y.view(-1, 24), routed + shared) < 1e-5


def test_record_and_replay_routes():
    model = bb.models.build("qwen3-moe-tiny", seed=2)
    ids = torch.randint(0, 1024, (2, 11))
    with moe.record_routes(model) as recorded, torch.no_grad():
        want = model(ids).logits
        routes = recorded()
    assert len(routes) == 2 and routes[0].shape == (22, 2)
    assert all(r.mode is None and r.routed_experts is None for r in moe.routers(model).values())  # restored
    with moe.replay_routes(model, routes), torch.no_grad():
        assert torch.equal(model(ids).logits, want)  # replaying the recorded routes reproduces the forward
    seen = []
    hooks = [r.register_forward_hook(lambda m, i, o: seen.append(o[2])) for r in moe.routers(model).values()]
    with torch.no_grad():  # perturb the routers: fresh routing now differs, replay keeps the experts
        for r in moe.routers(model).values():
            r.weight.add_(torch.randn_like(r.weight))
    with moe.replay_routes(model, routes):
        model(ids, labels=ids).loss.backward()
    for got, idx in zip(seen, routes):
        assert torch.equal(got, idx)
    for r in moe.routers(model).values():  # weights recomputed from the current scores: gradients flow
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    seen.clear()
    with torch.no_grad():  # the replay ended with its block: the routers choose again
        model(ids)
    assert any(not torch.equal(a, b) for a, b in zip(seen, routes))
    for h in hooks:
        h.remove()


def test_route_modes_are_restored_when_the_block_raises():
    model = bb.models.build("qwen3-moe-tiny", seed=2)
    routes = [torch.zeros(5, 2, dtype=torch.long)] * 2
    with pytest.raises(RuntimeError, match="inside"):
        with moe.replay_routes(model, routes):
            with moe.record_routes(model):
                assert {r.mode for r in moe.routers(model).values()} == {"record"}
            assert {r.mode for r in moe.routers(model).values()} == {"replay"}  # the outer block's mode again
            raise RuntimeError("inside")
    assert all(r.mode is None and r.routed_experts is None for r in moe.routers(model).values())


def test_replay_bad_routes_raise():
    model = bb.models.build("qwen3-moe-tiny", seed=2)
    ids = torch.randint(0, 1024, (1, 5))
    with pytest.raises(ValueError, match="one routed_experts tensor per MoE layer"):
        with moe.replay_routes(model, [torch.zeros(5, 2, dtype=torch.long)]):
            pass
    with pytest.raises(ValueError, match=r"\[N, k=2\]"):
        with moe.replay_routes(model, [torch.zeros(5, 3, dtype=torch.long)] * 2):
            pass
    with moe.replay_routes(model, [torch.full((5, 2), 8, dtype=torch.long)] * 2):
        with pytest.raises(ValueError, match="hold 8, outside the experts"):
            model(ids)
    with moe.replay_routes(model, [torch.zeros(4, 2, dtype=torch.long)] * 2):
        with pytest.raises(ValueError, match=r"must be \[T=5, k=2\]"):
            model(ids)


def test_router_family_mismatch_is_an_error():
    with pytest.raises(ValueError, match="does not compute softmax routing"):
        bb.models.build("qwen3-moe-tiny", impl={"router": "aux_free"})
