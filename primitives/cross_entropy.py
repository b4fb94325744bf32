"""Linear cross-entropy: LM-head matmul + loss + both gradients in vocabulary chunks, no [N, V] logits.

Algorithm (same on every device; the chunk work is a Triton kernel on CUDA, torch elsewhere):
  forward   for each vocabulary chunk C: z_NC = hidden_NH @ weight_CH^T (fp32 out), fold it into
            per-token fp32 statistics (running max, sum-exp, target logit, sum of logits, sum p*z);
            combine them over the vocab-parallel group; per-token loss and entropy from them.
  backward  recompute z_NC chunk by chunk, logit gradient g_NC from the saved statistics (fp32),
            dW_CH = g_NC^T @ hidden_NH (the whole N reduction inside one GEMM with fp32
            accumulation, written once), dH_NH += g_NC @ weight_CH into an fp32 accumulator.
Workspace: one fp32 z_NC chunk of LinearCE.workspace_bytes (g_NC is written over it), the fp32 [N, H] dH
accumulator, and a copy of the non-ignored hidden rows when some labels are ignored; nothing
scales with N x V. FLOPs: 8NHV (2 forward, 6 backward).
Shape suffixes: N tokens, H hidden, V (local) vocabulary, C chunk columns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from bumblebee.checks import check_cross_entropy_inputs
from bumblebee.distributed import vocab_range
from bumblebee.kernels.cross_entropy_linear import NEG_INIT, chunk_grad, chunk_stats_
from bumblebee.kernels import cross_entropy_linear as _kernels
from bumblebee.options import Bound, check_choice, check_int, option
from bumblebee.registry import needs_triton, register

MIN_CHUNK_COLUMNS = 1024  # below it the fp32 dH read-modify-write per chunk (8NH bytes) dominates
PATHS = ("auto", "grad_in_forward", "lean")


@dataclass(frozen=True)
class LinearCE:
    """Options of linear_ce: `impl={"cross_entropy": LinearCE(path="lean")}`, or the string
    "linear_ce:path=lean,budget_bytes=2GiB" (CLI: `--a linear_ce:path=lean`)."""

    impl_name = "linear_ce"  # not a field: the implementation these options configure
    path: str = option("auto", "grad_in_forward: the 6NHV path (gradients of a scalar loss computed in "
                       "the forward, 16-25% faster); lean: the 8NHV path (vocabulary chunks, logits "
                       "recomputed in the backward); auto: grad_in_forward when its workspace fits "
                       "budget_bytes, else lean")
    budget_bytes: int = option(4 << 30, "the most transient workspace auto lets the 6NHV path take "
                               "(grad_in_forward_rows x V fp32 logits + the fp32 [V, H] dW accumulator)")
    grad_in_forward_rows: int = option(2048, "token rows per chunk of the 6NHV path")
    workspace_bytes: int = option(128 << 20, "the lean path's fp32 logit chunk (the gradient chunk is "
                                  "written over it); grows past this beyond 32K tokens (MIN_CHUNK_COLUMNS)")
    chunk_columns: int | None = option(None, "fixed vocabulary columns per chunk of the lean path; None: "
                                       "derived from workspace_bytes")

    def __post_init__(self):
        check_choice(self, "path", PATHS)
        check_int(self, "budget_bytes", 0)
        check_int(self, "grad_in_forward_rows", 1)
        check_int(self, "workspace_bytes", 1)
        check_int(self, "chunk_columns", 1, optional=True)


_CUDA_MM: dict = {}  # dtype -> whether mm/addmm with out_dtype=float32 work (probed once)


def _chunk_columns(n: int, v: int, config: LinearCE) -> int:
    if config.chunk_columns is not None:
        return max(1, min(config.chunk_columns, v))
    cols = config.workspace_bytes // max(1, n * 4)
    return max(1, min(v, max(MIN_CHUNK_COLUMNS, cols // 256 * 256)))


def _fp32_out_ok(x: torch.Tensor) -> bool:
    """cuBLAS with low-precision operands and an fp32 output (torch's `out_dtype`), if available."""
    if not x.is_cuda or x.dtype == torch.float32:
        return False
    if x.dtype not in _CUDA_MM:
        try:
            a = torch.randn(64, 32, device=x.device, dtype=x.dtype)
            b = torch.randn(32, 48, device=x.device, dtype=x.dtype)
            ref = a.float() @ b.float()
            out = torch.empty(64, 48, device=x.device)
            torch.mm(a, b, out_dtype=torch.float32, out=out)
            acc = ref.clone()
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _CUDA_MM[x.dtype] = bool(torch.allclose(out, ref, atol=1e-2, rtol=1e-3)
                                     and torch.allclose(acc, 2 * ref, atol=2e-2, rtol=1e-3))
        except (RuntimeError, TypeError):
            _CUDA_MM[x.dtype] = False
    return _CUDA_MM[x.dtype]


def _logits(h_NH, w_CH, buf):
    """z_NC = h @ w^T with fp32 accumulation; fp32 result where the library can write one."""
    n, c = h_NH.shape[0], w_CH.shape[0]
    if h_NH.dtype in (torch.float32, torch.float64):
        return torch.mm(h_NH, w_CH.t(), out=buf[: n * c].view(n, c))
    if _fp32_out_ok(h_NH):
        return torch.mm(h_NH, w_CH.t(), out_dtype=torch.float32, out=buf[: n * c].view(n, c))
    return torch.mm(h_NH, w_CH.t())  # low-precision logits; the kernels read any dtype


def _accumulate(acc_NH, g_NC, w_CH):
    """acc += g @ w in fp32."""
    if g_NC.dtype == acc_NH.dtype:
        acc_NH.addmm_(g_NC, w_CH)
    elif _fp32_out_ok(g_NC):
        torch.addmm(acc_NH, g_NC, w_CH, out_dtype=torch.float32, out=acc_NH)
    else:
        acc_NH.add_(torch.mm(g_NC, w_CH).float())


def _grad_view(z_NC, dtype):
    """Where the logit gradient of a chunk goes: over the logits themselves (same dtype), or the
    first half of each fp32 row viewed as 16-bit (row stride 2C). Each kernel row program reads a
    block, then (after a barrier across its warps) writes the lower bytes of that block: safe."""
    if z_NC.dtype == dtype:
        return z_NC
    if z_NC.element_size() == 2 * torch.empty((), dtype=dtype).element_size() and z_NC.is_contiguous():
        return z_NC.view(dtype)[:, : z_NC.shape[1]]
    return torch.empty(z_NC.shape, device=z_NC.device, dtype=dtype)


def _chunks(v: int, cols: int):
    return [(c0, min(v, c0 + cols)) for c0 in range(0, v, cols)]


def _finish(m_N, d_N, tgt_N, zsum_N, pz_N, valid, vocab, smoothing, z_loss, want_entropy, group):
    """Combine the shards' statistics (one max, one sum) and form per-token loss and entropy."""
    if group is not None:
        m_g = m_N.clone()
        dist.all_reduce(m_g, op=dist.ReduceOp.MAX, group=group)
        scale = torch.exp(m_N - m_g)
        packed = torch.stack([d_N * scale, tgt_N, zsum_N, pz_N * scale])
        dist.all_reduce(packed, group=group)
        m_N, (d_N, tgt_N, zsum_N, pz_N) = m_g, packed.unbind(0)
    lse_N = m_N + torch.log(d_N)
    loss_N = lse_N - tgt_N
    if smoothing > 0:
        loss_N = (1 - smoothing) * loss_N + smoothing * (lse_N - zsum_N / vocab)
    if z_loss > 0:
        loss_N = loss_N + z_loss * lse_N.square()
    zero = torch.zeros((), device=m_N.device, dtype=m_N.dtype)
    loss_N = torch.where(valid, loss_N, zero)
    s_N = pz_N / d_N  # E_p[z]
    ent_N = torch.where(valid, lse_N - s_N, zero) if want_entropy else zero.expand(m_N.shape[0])
    return loss_N, ent_N, lse_N, s_N


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, valid, offset, vocab, smoothing, z_loss, temperature,
                want_entropy, group, cols):
        n, v = hidden.shape[0], weight.shape[0]
        dev = hidden.device
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        lab_N = torch.where(valid, labels.long() - offset, -1)  # local index; outside [0, v): not ours
        m_N = torch.full((n,), NEG_INIT, device=dev, dtype=acc)
        d_N, tgt_N, zsum_N, pz_N = torch.zeros(4, n, device=dev, dtype=acc).unbind(0)
        buf = torch.empty(n * cols, device=dev, dtype=acc)
        inv_t = 1.0 / temperature
        for c0, c1 in _chunks(v, cols):
            z_NC = _logits(hidden, weight[c0:c1], buf)
            chunk_stats_(z_NC, lab_N - c0, m_N, d_N, tgt_N, zsum_N, pz_N, inv_t,
                         smooth=smoothing > 0, entropy=want_entropy)
        del buf
        loss_N, ent_N, lse_N, s_N = _finish(m_N, d_N, tgt_N, zsum_N, pz_N, valid, vocab, smoothing,
                                            z_loss, want_entropy, group)
        ctx.save_for_backward(hidden, weight, lab_N, valid, lse_N, s_N)
        ctx.args = (vocab, smoothing, z_loss, inv_t, want_entropy, group, cols)
        if not want_entropy:
            ctx.mark_non_differentiable(ent_N)
        return loss_N, ent_N

    @staticmethod
    def backward(ctx, g_loss, g_ent):
        hidden, weight, lab_N, valid, lse_N, s_N = ctx.saved_tensors
        vocab, smoothing, z_loss, inv_t, want_entropy, group, cols = ctx.args
        n, v = hidden.shape[0], weight.shape[0]
        acc = lse_N.dtype
        fv = valid.to(acc)
        gl = fv * (g_loss.to(acc) if g_loss is not None else torch.zeros_like(lse_N))
        ge = fv * g_ent.to(acc) if (want_entropy and g_ent is not None) else None
        a_N = gl * (1 + 2 * z_loss * lse_N)
        b_N = gl * (1 - smoothing)
        c_N = gl * (smoothing / vocab)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.zeros(hidden.shape, device=hidden.device, dtype=acc) if need_h else None
        dw = torch.empty_like(weight) if need_w else None
        buf = torch.empty(n * cols, device=hidden.device, dtype=acc)
        for c0, c1 in _chunks(v, cols):
            w_CH = weight[c0:c1]
            z_NC = _logits(hidden, w_CH, buf)
            g_NC = chunk_grad(z_NC, _grad_view(z_NC, hidden.dtype), lab_N - c0, lse_N,
                              a_N, b_N, c_N, ge, s_N if ge is not None else None, inv_t)
            if need_w:
                torch.mm(g_NC.t(), hidden, out=dw[c0:c1])
            if need_h:
                _accumulate(dh, g_NC, w_CH)
        if need_h and group is not None:
            dist.all_reduce(dh, group=group)
        dh = dh.to(hidden.dtype) if need_h else None
        return dh, dw, *([None] * 10)


class _LinearCEGradInForward(torch.autograd.Function):
    """The 6NHV variant: token-row chunks over the whole vocabulary; the gradients of a scalar loss
    (mean/sum) are computed in the forward and scaled by the upstream scalar in the backward.
    Needs an fp32 [V, H] dW accumulator (the N reduction spans chunks)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, valid, offset, vocab, smoothing, z_loss, temperature,
                mean, group, rows):
        n, v = hidden.shape[0], weight.shape[0]
        dev = hidden.device
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        lab_N = torch.where(valid, labels.long() - offset, -1)
        rows = max(1, min(n, rows))
        buf = torch.empty(rows * v, device=dev, dtype=acc)
        dh = torch.empty(hidden.shape, device=dev, dtype=hidden.dtype)
        dw = torch.zeros(weight.shape, device=dev, dtype=acc)
        inv_t = 1.0 / temperature
        scale = 1.0 / valid.sum().clamp(min=1).to(acc) if mean else torch.ones((), device=dev, dtype=acc)
        total = torch.zeros((), device=dev, dtype=acc)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            h_RH, lab_R = hidden[r0:r1], lab_N[r0:r1]
            z_RV = _logits(h_RH, weight, buf)
            st = [torch.full((r1 - r0,), NEG_INIT, device=dev, dtype=acc),
                  *torch.zeros(4, r1 - r0, device=dev, dtype=acc).unbind(0)]
            chunk_stats_(z_RV, lab_R, *st, inv_t, smooth=smoothing > 0, entropy=False)
            loss_R, _, lse_R, _ = _finish(*st, valid[r0:r1], vocab, smoothing, z_loss, False, group)
            total += loss_R.sum()
            gl = valid[r0:r1].to(acc) * scale
            g_RV = chunk_grad(z_RV, _grad_view(z_RV, hidden.dtype), lab_R, lse_R,
                              gl * (1 + 2 * z_loss * lse_R), gl * (1 - smoothing),
                              gl * (smoothing / vocab), None, None, inv_t)
            if group is None:
                torch.mm(g_RV, weight, out=dh[r0:r1])
            else:
                d = torch.zeros(r1 - r0, hidden.shape[1], device=dev, dtype=acc)
                _accumulate(d, g_RV, weight)
                dist.all_reduce(d, group=group)
                dh[r0:r1] = d
            _accumulate(dw, g_RV.t(), h_RH)  # fp32 accumulation across the row chunks
        ctx.save_for_backward(dh, dw.to(weight.dtype))
        return total * scale

    @staticmethod
    def backward(ctx, g):
        dh, dw = ctx.saved_tensors
        s = float(g)  # a Python scalar multiplies in fp32 (a bf16 cast of g would add 2^-9 error)
        if s != 1.0:
            dh, dw = dh * s, dw * s
        return (dh, dw, *([None] * 10))


def grad_in_forward_workspace_bytes(n: int, v: int, h: int, config: LinearCE = LinearCE()) -> int:
    """Transient bytes of the 6NHV variant beyond the lean path: one fp32 rows x V logit chunk and
    the fp32 [V, H] dW accumulator."""
    return 4 * (max(1, min(n, config.grad_in_forward_rows)) * v + v * h)


def _grad_in_forward(hidden, weight, reduction, return_entropy, config: LinearCE) -> bool:
    """The 6NHV variant serves a scalar loss whose backward will run (path=grad_in_forward too);
    "auto" also needs its workspace to fit the budget (else the lean path)."""
    if config.path == "lean" or reduction == "none" or return_entropy or not torch.is_grad_enabled():
        return False
    if not (hidden.requires_grad or weight.requires_grad):
        return False
    if config.path == "auto":
        n, v, h = hidden.shape[0], weight.shape[0], hidden.shape[1]
        return grad_in_forward_workspace_bytes(n, v, h, config) <= config.budget_bytes
    return True


@register("cross_entropy", "linear_ce", kind="primitive", twin="materialized_ce", default=True, config=LinearCE,
          falls_back=needs_triton(_kernels))
def linear_cross_entropy_with(config: LinearCE, hidden, weight, labels, *, ignore_index=-100, reduction="mean",
                              label_smoothing=0.0, z_loss_scale=0.0, temperature=1.0,
                              return_entropy=False, process_group=None):
    """Chunked LM-head + cross-entropy (Triton on CUDA): never materializes the [N, V] logits."""
    offset, vocab = vocab_range(weight.shape[0], process_group, hidden.device)
    check_cross_entropy_inputs(hidden, weight, labels, ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing, temperature=temperature,
                               vocab_offset=offset, vocab_total=vocab, z_loss_scale=z_loss_scale)
    valid = labels != ignore_index
    n_valid = int(valid.sum())  # one host sync (the label check already made one)
    if 0 < n_valid < labels.shape[0]:  # ignored rows contribute nothing: drop them from the GEMMs
        idx = valid.nonzero()[:, 0]
        out = linear_cross_entropy_with(config, hidden.index_select(0, idx), weight,
                                        labels.index_select(0, idx), ignore_index=ignore_index,
                                        reduction=reduction, label_smoothing=label_smoothing,
                                        z_loss_scale=z_loss_scale, temperature=temperature,
                                        return_entropy=return_entropy, process_group=process_group)
        if reduction != "none" and not return_entropy:
            return out
        loss, entropy = out if return_entropy else (out, None)
        if reduction == "none":
            loss = loss.new_zeros(labels.shape[0]).index_put((idx,), loss)
        if entropy is not None:
            entropy = entropy.new_zeros(labels.shape[0]).index_put((idx,), entropy)
        return (loss, entropy) if return_entropy else loss
    if _grad_in_forward(hidden, weight, reduction, return_entropy, config):
        return _LinearCEGradInForward.apply(hidden, weight, labels, valid, offset, vocab,
                                            float(label_smoothing), float(z_loss_scale),
                                            float(temperature), reduction == "mean", process_group,
                                            config.grad_in_forward_rows)
    loss, entropy = _LinearCE.apply(hidden, weight, labels, valid, offset, vocab,
                                    float(label_smoothing), float(z_loss_scale), float(temperature),
                                    bool(return_entropy), process_group,
                                    _chunk_columns(hidden.shape[0], weight.shape[0], config))
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / max(n_valid, 1)
    return (loss, entropy) if return_entropy else loss


# The public function: linear_ce with its default options (the twin's signature); a model's impl
# choice gets it bound to the chosen ones by `registry.resolve`.
linear_cross_entropy = Bound(linear_cross_entropy_with, LinearCE())
