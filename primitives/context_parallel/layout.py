"""The sequence layout under context parallelism: one permutation for the whole model.

A row of T tokens (or a packed stream of documents, B = 1) is cut into 2 x CP equal chunks; rank r
holds chunk r and chunk 2 CP - 1 - r, in that order ("head-tail" or zigzag). Under a causal mask
chunk c attends to c + 1 chunks, so every rank's pair does 2 CP + 1 chunk-pairs of work: the load
is even.

The same permutation serves gated DeltaNet: its recurrence needs the chunks in order 0 .. 2 CP - 1,
and each chunk's state depends on everything before it only through one affine map of the state
entering it (S_out = A S_in + B). Each rank computes (A, B) of its two chunks, one all-gather brings
every chunk's pair, and every rank composes them in chunk order to get the exact fp32 state entering
each of its chunks (`gdn.py`). So no layer needs another layout, and no re-permutation between
attention and DeltaNet layers is ever paid.

Packed documents (`cu_seqlens` over the stream) need no alignment to the chunks: every token carries
its global index and its document's start, masks and conv taps follow them, and a document may span
chunks and ranks, be shorter than a chunk, or be one token long.

Labels are shifted on the full sequence before sharding (`shard_batch`): a chunk's last token
predicts the first token of the next chunk, which another rank holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from bumblebee.checks import check_cu_seqlens


def check_cp(T: int, cp: int, name: str = "T") -> int:
    """The chunk length T / (2 cp); ValueError naming `name` unless it divides."""
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"context parallel size must be a positive int, got {cp!r}")
    if T % (2 * cp):
        raise ValueError(f"{name}={T} must be divisible by 2 x CP = {2 * cp} (pad the sequence)")
    return T // (2 * cp)


def rank_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two global chunks rank `rank` holds, in its local order."""
    return rank, 2 * cp - 1 - rank


def gather_slot(c: int, cp: int) -> int:
    """Where chunk c sits in a gather of every rank's two chunks (layout order)."""
    return 2 * c if c < cp else 2 * (2 * cp - 1 - c) + 1


def local_index(T: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """[T / cp] the global positions of this rank's tokens, in local order."""
    L = check_cp(T, cp)
    return torch.cat([torch.arange(c * L, (c + 1) * L, device=device) for c in rank_chunks(rank, cp)])


def layout_index(T: int, cp: int, device=None) -> torch.Tensor:
    """[T] the global position of every token in layout order (rank 0's tokens, then rank 1's, ...)."""
    return torch.cat([local_index(T, cp, r, device) for r in range(cp)])


def shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of x along `dim` (a copy)."""
    return x.index_select(dim, local_index(x.shape[dim], cp, rank, x.device))


def unshard(pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (rank order) along `dim`."""
    cp = len(pieces)
    x = torch.cat(pieces, dim=dim)
    order = torch.argsort(layout_index(x.shape[dim], cp, x.device))
    return x.index_select(dim, order)


def doc_starts(cu_seqlens, n: int, device) -> torch.Tensor:
    """[n] the global index where each token's document starts (0 for an unpacked row)."""
    if cu_seqlens is None:
        return torch.zeros(n, dtype=torch.long, device=device)
    cu = check_cu_seqlens(cu_seqlens, n)
    lengths = torch.tensor([b - a for a, b in zip(cu, cu[1:])], device=device)
    return torch.repeat_interleave(torch.tensor(cu[:-1], device=device), lengths)


def next_token_targets(labels_BT: torch.Tensor, starts_T: torch.Tensor, ignore_index: int = -100, shift: int = 1):
    """Labels shifted left on the full sequence: token t's target is label t + shift, ignore_index
    past a row's end and where t + shift lies in another document."""
    T = labels_BT.shape[1]
    out = torch.full_like(labels_BT, ignore_index)
    out[:, :T - shift] = labels_BT[:, shift:]
    other = torch.ones_like(starts_T, dtype=torch.bool)
    other[:T - shift] = starts_T[shift:] != starts_T[:T - shift]
    return out.masked_fill(other, ignore_index)


def shifted_ids(ids_BT: torch.Tensor, shift: int) -> torch.Tensor:
    """ids[t + shift], token 0 past the row's end (its targets are masked; the default MTP
    implementation, `primitives/mtp.py`, fills the same, so MoE router loads agree too)."""
    return torch.nn.functional.pad(ids_BT[:, shift:], (0, min(shift, ids_BT.shape[1])), value=0)


@dataclass(frozen=True, eq=False)
class CPBatch:
    """What every context-parallel layer needs about the batch, passed where a layer takes
    `cu_seqlens` (so it travels through a model's full recompute with the layer's arguments).

    index [T / cp]: global positions of this rank's tokens; starts [T / cp]: their documents' starts;
    all_starts [T]: the document start of every global position (unpacked: zeros)."""

    group: object
    cp: int
    rank: int
    T: int
    index: torch.Tensor
    starts: torch.Tensor
    all_starts: torch.Tensor
    packed: bool
    lo: tuple  # per local chunk: the first global position any of its queries may attend to
    cuts: tuple  # per local chunk: the local offsets where a document starts inside it (0: at its start)
    bounds: tuple = ()  # the global cu_seqlens of a row ((0, T) unpacked)
    context_parallel = True  # models/causal_lm.py: positions and labels come set on the full sequence

    @property
    def chunk(self) -> int:
        return self.T // (2 * self.cp)

    @property
    def local(self) -> int:
        return 2 * self.chunk

    def chunk_index(self, i: int) -> torch.Tensor:
        return self.index[i * self.chunk:(i + 1) * self.chunk]

    def segments(self, i: int) -> list[tuple[int, int, int]]:
        """Local chunk i cut at its document starts: (a, b, start) per piece, its query rows [a, b) in
        the chunk and the global start of their one document (unpacked: one piece, start 0)."""
        c, L = rank_chunks(self.rank, self.cp)[i], self.chunk
        bounds = sorted({0, L, *self.cuts[i]})
        return [(a, b, self.lo[i] if a == 0 else c * L + a) for a, b in zip(bounds, bounds[1:])]


def make_batch(group, T: int, cu_seqlens=None, device=None) -> CPBatch:
    """The CPBatch of this rank for rows of T global tokens (cu_seqlens over them: B = 1 packed)."""
    cp, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    check_cp(T, cp)
    all_starts = doc_starts(cu_seqlens, T, device)
    index = local_index(T, cp, rank, device)
    L = T // (2 * cp)
    lo = tuple(int(all_starts[c * L]) for c in rank_chunks(rank, cp))  # starts are non-decreasing
    cu = [0, T] if cu_seqlens is None else check_cu_seqlens(cu_seqlens, T)
    cuts = tuple(tuple(a - c * L for a in cu[:-1] if c * L <= a < (c + 1) * L) for c in rank_chunks(rank, cp))
    return CPBatch(group, cp, rank, T, index, all_starts[index], all_starts, cu_seqlens is not None, lo, cuts,
                   tuple(int(a) for a in cu))


@dataclass
class Shard:
    """A batch's shard for this rank: model inputs and targets, and the global target count."""

    input_ids: torch.Tensor  # [B, T / cp]
    position_ids: torch.Tensor  # [B, T / cp] positions inside each document (RoPE)
    targets: torch.Tensor  # [B, T / cp] next-token targets, shifted on the full sequence
    count: int  # valid targets of the whole batch (every rank's loss divides by it)
    batch: CPBatch
    mtp_ids: tuple = ()  # per MTP depth k = 1..D: [B, T / cp] the tokens k ahead
    mtp_targets: tuple = ()  # per depth: [B, T / cp] the labels k + 1 ahead, in the token's document
    mtp_counts: tuple = ()  # per depth: valid targets of the whole batch


def shard_batch(input_ids: torch.Tensor, labels: torch.Tensor | None, group, cu_seqlens=None,
                ignore_index: int = -100, mtp_depths: int = 0) -> Shard:
    """Shard a full batch [B, T] (each cp rank holds the same one): positions restart per document,
    labels (default input_ids) are shifted before sharding, the counts are global; `mtp_depths`: the
    shifted tokens and targets of that many MTP depths too. Packed (`cu_seqlens` over the B*T tokens)
    with B > 1: the rows are sharded as one stream of B*T tokens (the shard's B is 1), attention and
    recurrence follow the documents across row ends, labels shift per row as the models do."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
    row_ends = None
    if cu_seqlens is not None and B > 1:  # the models' packed convention: the B*T tokens are one stream
        if mtp_depths:
            raise ValueError(f"mtp_depths under context parallelism needs one packed row (B = 1), got B = {B}")
        row_ends = torch.arange(T - 1, B * T, T, device=input_ids.device)
        input_ids, labels, B, T = input_ids.reshape(1, B * T), labels.reshape(1, B * T), 1, B * T
    batch = make_batch(group, T, cu_seqlens, input_ids.device)
    positions = (torch.arange(T, device=input_ids.device) - batch.all_starts).expand(B, T)
    targets = next_token_targets(labels, batch.all_starts, ignore_index)
    if row_ends is not None:  # as the models shift labels: per row, a row's last token predicts nothing
        targets[:, row_ends] = ignore_index
    count = int((targets != ignore_index).sum())
    pick = lambda t: t.index_select(1, batch.index)  # noqa: E731
    mtp = [next_token_targets(labels, batch.all_starts, ignore_index, k + 1) for k in range(1, mtp_depths + 1)]
    return Shard(pick(input_ids), pick(positions), pick(targets), count, batch,
                 tuple(pick(shifted_ids(input_ids, k)) for k in range(1, mtp_depths + 1)),
                 tuple(pick(t) for t in mtp), tuple(int((t != ignore_index).sum()) for t in mtp))
