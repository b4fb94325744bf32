"""Context parallelism: one sequence sharded over the ranks of a `cp` group.

- `layout.py`: the one permutation of the whole model (rank r holds chunks r and 2 CP - 1 - r),
  shard / unshard, `shard_batch` (positions, targets shifted on the full sequence, global count),
  `CPBatch` (what the layers need, passed where they take `cu_seqlens`);
- `comm.py`: the differentiable all-gather (reduce-scatter backward) and the ring shift;
- `attention.py`: causal GQA attention by all-gather of K/V or by a ring exchange (the dispatch;
  the ring's masked form for CUDA fp32);
- `flash.py`: the two exchanges on fused blocks, per document piece of a chunk (no mask);
- `kernels.py`: one block's forward (output, log-sum-exp) and backward: cuDNN or flash on CUDA;
- `gdn.py`: gated DeltaNet: conv halo, exact fp32 state passing through the chunks' affine maps
  (one call of fla's rule per rank on CUDA);
- `gdn_fla.py`: gated DeltaNet on fla 0.6's own CP kernels (`ContextParallel(deltanet="fla")`, CUDA);
  `gdn_fla_chain.py`: their chain pass with a rank's two parts scanned at once (`fla_concurrent_parts`)
  and the transition maps from `kernels/context_parallel_gdn_transition.py` (`fla_transition`);
- `mla.py`: MLA by an all-gather of the latent and RoPE key, heads expanded on each rank;
- `model.py`: `apply(model, cp_group, ContextParallel(...))` swaps a built model's sequence-mixing
  layers, `loss(model, shard)` its share of the mean loss (MTP included), `sync_grads`.

The twin is the same layer on the full sequence on one rank (tests/primitives/test_context_parallel*.py).
"""
from bumblebee.primitives.context_parallel.layout import (  # noqa: F401
    CPBatch, Shard, make_batch, shard, shard_batch, unshard)
from bumblebee.primitives.context_parallel.model import ContextParallel, apply, loss, sync_grads  # noqa: F401
from bumblebee.primitives.context_parallel import model  # noqa: F401
