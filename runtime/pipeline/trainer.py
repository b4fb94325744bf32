"""One GRPO update through the runtime (no Ray here: the trainer actor calls it, and so can a plain
synchronous loop): dynamic sampling, group-normalized advantages, the proximal policy's log-probs,
the capped behaviour weight, DAPO's clip-higher surrogate with token-mean aggregation, the step."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime

import torch

from bumblebee.runtime import losses
from bumblebee.runtime.batching import Batch
from bumblebee.runtime.pipeline.admission import Admission, Lease
from bumblebee.runtime.pipeline.config import Objective, PipelineConfig, PipelineTimeout
from bumblebee.runtime.pipeline.engine import rollout
from bumblebee.runtime.pipeline.samples import Completion, Group, informative, to_batch


def build_runtime(model_config: dict, cfg: PipelineConfig, group=None, device="cpu", ep_mesh=None):
    """(Runtime of the policy, Runtime of the reference or None): the model on `device` under
    `cfg.state_sharding` on `group` (the trainer's own ranks), or on a one-rank group (gloo, and NCCL
    for CUDA), created here when none exists (the trainer actor's own process). With
    `cfg.expert_parallel` = EP > 1 each rank keeps E / EP experts (`shard_experts` on the (efsdp, ep)
    mesh `ep_mesh` over the ranks of `group`, `trainer_expert_mesh`'s; without one it is made here
    over `group`, which must then be the default group: its subgroups are made by every rank of it)
    and the MoE dispatch is "all_to_all" unless `cfg.impl` names "chunked". Every group made here
    waits at most `cfg.trainer_timeout_s` (torch's own default is 30 minutes).
    On CUDA the caller's current device must be `device` (the mesh takes the current one)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from bumblebee import models, registry
    from bumblebee.runtime import Runtime
    device = torch.device(device)
    if group is not None:
        mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=("dp",))
    else:
        if not dist.is_initialized():  # one rank: an in-memory store, no port to find
            backend = "gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=cfg.trainer_timeout_s))
        if dist.get_world_size() != 1:
            raise ValueError(f"group=None builds a one-rank trainer; the default group has {dist.get_world_size()} "
                             f"ranks: pass the trainer's group")
        mesh = DeviceMesh.from_group(dist.group.WORLD, device.type, mesh_dim_names=("dp",))
    impl, ep = dict(cfg.impl), cfg.expert_parallel
    if ep > 1:
        impl.setdefault("moe_dispatch", "all_to_all")
        if impl["moe_dispatch"] not in ("all_to_all", "chunked"):
            raise ValueError(f"expert_parallel={ep} needs impl['moe_dispatch'] 'all_to_all' or 'chunked', "
                             f"got {impl['moe_dispatch']!r}")
        if ep_mesh is not None:
            if ep_mesh.mesh_dim_names != ("efsdp", "ep") or ep_mesh["ep"].size() != ep or \
                    sorted(ep_mesh.mesh.flatten().tolist()) != sorted(mesh.mesh.flatten().tolist()):
                raise ValueError(f"ep_mesh must be an (efsdp, ep) mesh with ep = expert_parallel = {ep} over the "
                                 f"trainer's ranks {mesh.mesh.flatten().tolist()}, got {ep_mesh}")
        elif mesh.size() % ep or (group is not None and dist.get_world_size() != mesh.size()):
            raise ValueError(f"expert_parallel={ep} needs the trainer's ranks ({mesh.size()}) to be a multiple of "
                             f"it and, without an ep_mesh, to make up the whole default group "
                             f"({dist.get_world_size()} ranks)")
    model = models.build(model_config, impl=impl, seed=cfg.seed, device=device)
    kw = {}
    if ep > 1:
        from bumblebee.parallelize import shard_experts
        # not init_device_mesh: its subgroups would wait torch's default 30 minutes on a stalled rank
        kw["ep_mesh"] = ep_mesh or trainer_expert_mesh(mesh.size(), ep, device_type=device.type,
                                                       timeout=datetime.timedelta(seconds=cfg.trainer_timeout_s))
        shard_experts(model, kw["ep_mesh"]["ep"].get_group())
    state = registry.resolve("state_sharding", cfg.state_sharding)(model, mesh, lr=cfg.lr, mixed_precision="fp32",
                                                                   grad_clip=cfg.grad_clip, **kw)
    ref = Runtime(models.build(model_config, seed=cfg.seed, device=device)) if cfg.objective.kl_coef else None
    return Runtime(model, state), ref


def join_trainer_ranks(cfg: PipelineConfig, address: str, rank: int, device) -> None:
    """Trainer rank `rank` of `cfg.trainer_ranks` joins their default group at `address` ("host:port"
    of rank 0), gloo (and NCCL for CUDA), waiting at most `cfg.trainer_timeout_s` in any collective."""
    import torch.distributed as dist
    backend = "gloo" if torch.device(device).type == "cpu" else "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=cfg.trainer_ranks,
                            timeout=datetime.timedelta(seconds=cfg.trainer_timeout_s))


@contextlib.contextmanager
def collective_limit(cfg: PipelineConfig, what: str):
    """Raise a collective's timeout on the trainer's groups (gloo: a RuntimeError "Timed out ...",
    which names neither the group nor the option) as a PipelineTimeout naming `what` and the limit."""
    try:
        yield
    except RuntimeError as e:
        if "timed out" not in str(e).lower():
            raise
        raise PipelineTimeout(f"{what}: a collective of the trainer's ranks waited past trainer_timeout_s = "
                              f"{cfg.trainer_timeout_s:g} s (take_timeout_s + 2 * call_timeout_s): a peer rank "
                              f"stalled or died ({e})") from e


def trainer_expert_mesh(trainers: int, ep: int, *, timeout=None, device_type: str = "cpu"):
    """The trainer's (efsdp, ep) mesh over global ranks 0..trainers-1 (ep groups: runs of `ep`
    consecutive ranks, as `init_device_mesh` lays them out) in a default group that may hold more
    ranks (the p2p channel's producers). Every rank of the default group calls it, in the same order
    of group creation (`new_group` is world-wide); a rank outside the trainer's gets None. The groups
    wait at most `timeout` (a timedelta; None: torch's default, 30 minutes, whatever the default
    group's). Not primitives/context_parallel's `expert_mesh`: that one regroups the ranks of a
    (dp, cp) mesh spanning the whole default group, with torch's default wait."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    if not (isinstance(ep, int) and ep > 0 and trainers % ep == 0):
        raise ValueError(f"ep must be an int > 0 dividing trainers={trainers}, got {ep!r}")
    ranks = torch.arange(trainers).view(trainers // ep, ep)
    me, mine = dist.get_rank(), []
    for along in (ranks.t(), ranks):  # efsdp groups (the columns), then ep groups (the rows)
        for members in along.tolist():
            g = dist.new_group(members, timeout=timeout)
            if me in members:
                mine.append(g)
    if not mine:
        return None
    return DeviceMesh.from_group(mine, device_type, mesh=ranks, mesh_dim_names=("efsdp", "ep"))


@contextlib.contextmanager
def own_default_group():
    """Destroys, on exit, the default process group if one was made inside (the one-rank trainer of
    `build_runtime(group=None)`): an in-process run leaves no global torch.distributed state behind
    it, so a later init_process_group in the same process works."""
    import torch.distributed as dist
    had = dist.is_available() and dist.is_initialized()
    try:
        yield
    finally:
        if not had and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def synchronous_run(cfg: PipelineConfig, model_config: dict, task, engine) -> list[dict]:
    """The plain synchronous loop in one process, no Ray: export, generate every group of the step on
    those weights, train, for `cfg.steps` steps. The pipeline at eta = 0 with one producer leasing a
    whole step per call (`groups_per_call >= groups_per_step`) makes the same updates."""
    return lagged_run(dataclasses.replace(cfg, eta=0), model_config, task, engine)


def lagged_run(cfg: PipelineConfig, model_config: dict, task, engine) -> list[dict]:
    """The loop in one process at the most staleness admission allows, deterministically: step b's
    groups are generated on the weights of version max(0, b - cfg.eta), then trained at version b
    (eta = 0: the synchronous loop). What an asynchronous run does at its worst, without its timing."""
    with own_default_group():
        return _lagged_run(cfg, model_config, task, engine)


def _lagged_run(cfg: PipelineConfig, model_config: dict, task, engine) -> list[dict]:
    rt, ref = build_runtime(model_config, cfg)
    adm, prompts, log = Admission(cfg.groups_per_step, cfg.eta, cfg.steps), task.prompts(cfg.seed), []
    snapshots = {}  # version -> exported weights, the last eta + 1 of them
    for step in range(cfg.steps):
        snapshots[step] = [(n, t.clone()) for n, t in rt.export_weights(dtype=torch.float32)]
        snapshots.pop(step - cfg.eta - 1, None)
        behind = max(0, step - cfg.eta)
        engine.load_weights(snapshots[behind], behind)
        groups = []
        while len(groups) < cfg.groups_per_step:
            leases = []
            while len(leases) < min(cfg.groups_per_call, cfg.groups_per_step - len(groups)):
                lease = adm.admit(0, behind)
                if not isinstance(lease, Lease):  # ticket `step` on version step - eta: always admitted
                    raise RuntimeError(f"step {step}: admission answered {lease!r}")
                leases.append((lease, *next(prompts)))
            groups += rollout(engine, task, leases, cfg)
        log.append(grpo_step(rt, groups, cfg.objective, version=step, pad_id=task.pad_id, ref=ref))
    return log


def grpo_step(rt, groups: list[Group], objective: Objective, *, version: int, pad_id: int, ref=None,
              rank: int = 0, world: int = 1, group=None) -> dict:
    """Train `rt` (a Runtime with a state) one optimizer step on `groups`, consumed at weights
    `version`; `ref`: a Runtime of the reference policy (for `objective.kl_coef`). Returns metrics.
    Over `world` data-parallel ranks of `group` (every rank holds every group), rank r trains the
    kept groups r, r + world, ...; the token mean divides by the count over all ranks, so the update
    is the one-rank update; a rank left without a group runs one with nothing trained (the
    collectives stay matched). Loss, KL, entropy and clip fraction are then over all ranks."""
    kept = informative(groups) if objective.dynamic_sampling else groups
    lengths = [len(c.tokens) for g in groups for c in g.completions]
    stale = [version - min(c.versions) for g in groups for c in g.completions if c.versions]
    m = {"version": version, "reward": sum(r for g in groups for r in g.rewards) / len(lengths),
         "groups": len(groups), "groups_kept": len(kept), "staleness_max": max(stale, default=0),
         "staleness_mean": sum(stale) / max(len(stale), 1), "tokens": sum(lengths), "lengths": lengths,
         "spans_max": max((len(c.spans) for g in groups for c in g.completions), default=0),
         "reward_by_version": _reward_by_version(groups, version)}
    if not kept:  # every group all-equal: nothing to learn from; the weights stay (the version advances)
        opt = rt.optim_step()
        return {**m, "applied": opt["applied"], "loss": 0.0, "grad_norm": 0.0, "behave_kl": 0.0, "kl": 0.0,
                "entropy": float("nan"), "clip_fraction": 0.0, "behave_weight_max": 1.0}
    mine = kept[rank::world]
    batch, mask, prox, res = _ppo_pass(rt, mine or kept[:1], objective, pad_id=pad_id, ref=ref, train=bool(mine))
    behave = batch.sampler_logprobs
    opt = rt.optim_step()
    with torch.no_grad():
        n = mask.sum().clamp_min(1)
        behave_kl = (losses.kl_penalty(prox, behave, "low_var_kl") * mask).sum() / n  # KL(prox || behave), k3
        raw_w = torch.exp(prox - behave)
        out = {"loss": res.loss, "behave_kl": float(behave_kl), "kl": res.metrics.get("kl", 0.0),
               "entropy": float((res.entropy * mask).sum() / n), "clip_fraction": res.metrics["clip_fraction"],
               "behave_weight_max": float(raw_w[mask].max()) if mine else 0.0}
        if world > 1:
            out = _over_ranks(out, int(mask.sum()), group)
    return {**m, "applied": opt["applied"], "grad_norm": float(opt["grad_norm"]), **out}


def _reward_by_version(groups: list[Group], version: int) -> dict:
    """{str(v): [reward sum, completions]} by the version that sampled each completion's first token
    (`version` for an empty one): the policy each reward measures, which lags the trainer's by up to eta."""
    out: dict = {}
    for g in groups:
        for c, r in zip(g.completions, g.rewards):
            s = out.setdefault(str(c.versions[0] if c.versions else version), [0.0, 0])
            s[0] += r
            s[1] += 1
    return out


def _ppo_pass(rt, groups: list[Group], objective: Objective, *, pad_id: int, ref, train: bool):
    """(batch, trained mask, pi_prox's log-probs, forward_backward's result) of `groups`: the proximal
    policy's forward, the capped behaviour weight, the clip-higher surrogate's forward and backward
    (gradients added, no step); `train` False: every token masked out (nothing trained, the same calls)."""
    device = next(rt.model.parameters()).device
    batch, _ = to_batch(groups, pad_id, scale_by_std=objective.scale_by_std, device=device)
    mask = batch.loss_mask if train else torch.zeros_like(batch.loss_mask)
    prox = rt.forward(batch).log_probs  # pi_prox: the weights of this version, before the update
    w = losses.behaviour_weights(prox, batch.sampler_logprobs, cap=objective.behave_cap, mode=objective.behave_mode)
    ref_lp = ref.forward(batch).log_probs if objective.kl_coef else None
    train_batch = Batch(batch.input_ids, loss_mask=mask, weights=w * mask, advantages=batch.advantages,
                        sampler_logprobs=prox, ref_logprobs=ref_lp)
    res = rt.forward_backward(train_batch, "ppo", clip=(objective.clip_low, objective.clip_high),
                              loss_agg_mode="token-mean", kl_coef=objective.kl_coef,
                              entropy_coef=objective.entropy_coef, entropy=True)
    return batch, mask, prox, res


def warmup_step(rt, cfg: PipelineConfig, *, prompt: list[int], vocab: int, pad_id: int, ref=None,
                world: int = 1) -> None:
    """The calls of one `grpo_step` on a throwaway batch of a step's shape on this rank (its share of
    `cfg.groups_per_step` groups of `cfg.group_size` completions of `prompt`, random tokens of a
    private generator) with nothing trained: the first calls' costs (kernel loads, FSDP2's lazy
    init, the allocator's pool) are paid before a timed run. Every rank of the trainer calls it. The
    weights, optimizer state, step count and router biases stay as they were (the optimizer step
    skips: no trained token on any rank), and the global RNG is not drawn from."""
    gen = torch.Generator().manual_seed(0)
    n = cfg.sampling.max_new_tokens

    def completion():
        return Completion(torch.randint(vocab, (n,), generator=gen).tolist(), [-1.0] * n, [0] * n)
    groups = [Group(g, 0, list(prompt), [completion() for _ in range(cfg.group_size)],
                    [float(i % 2) for i in range(cfg.group_size)]) for g in range(-(-cfg.groups_per_step // world))]
    _ppo_pass(rt, groups, cfg.objective, pad_id=pad_id, ref=ref, train=False)
    opt = rt.optim_step()
    if opt["applied"]:  # the skip is what keeps the run's updates its own
        raise RuntimeError(f"the warm-up step moved the weights: {opt}")


def _over_ranks(local: dict, tokens: int, group) -> dict:
    """Each rank's metrics (means over its `tokens` trained tokens; the loss already its share of the
    global token mean) as the whole batch's: one all-reduce of the token-weighted sums, one of the max."""
    import torch.distributed as dist
    means = ("behave_kl", "kl", "entropy", "clip_fraction")
    sums = torch.tensor([local["loss"], tokens, *(local[k] * tokens for k in means)], dtype=torch.float64)
    dist.all_reduce(sums, group=group)
    top = torch.tensor([local["behave_weight_max"]], dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    n = max(float(sums[1]), 1.0)
    return {"loss": float(sums[0]), **{k: float(v) / n for k, v in zip(means, sums[2:])},
            "behave_weight_max": float(top[0])}
