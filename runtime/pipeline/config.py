"""Typed options of the asynchronous RL pipeline (frozen dataclasses, validated on construction)."""
from __future__ import annotations

from dataclasses import dataclass, field

from bumblebee.runtime.losses import BEHAVE_MODES


WEIGHT_CHANNELS = ("object_store", "p2p")


@dataclass(frozen=True)
class Sampling:
    """How producers sample. `chunk_tokens`: generate this many tokens per engine call and take newer
    weights between calls (in-flight updates, PipelineRL); None: a completion on one version."""
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    chunk_tokens: int | None = None

    def __post_init__(self):
        _positive("max_new_tokens", self.max_new_tokens)
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.chunk_tokens is not None:
            _positive("chunk_tokens", self.chunk_tokens)


@dataclass(frozen=True)
class Objective:
    """The trainer's loss: GRPO advantages (group-normalized rewards, divided by the group's std when
    `scale_by_std`), DAPO's clip-higher surrogate (ratio to the proximal policy clipped to
    [1 - clip_low, 1 + clip_high]) with token-mean aggregation, DAPO's dynamic sampling (groups whose
    rewards are all equal are dropped: their advantages are 0), and the decoupled behaviour weight
    pi_prox / pi_behave capped at `behave_cap` by `behave_mode` ("clamp" or "mask")."""
    clip_low: float = 0.2
    clip_high: float = 0.28
    behave_cap: float = 2.0
    behave_mode: str = "clamp"
    dynamic_sampling: bool = True
    scale_by_std: bool = True
    kl_coef: float = 0.0
    entropy_coef: float = 0.0

    def __post_init__(self):
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.behave_mode not in BEHAVE_MODES:
            raise ValueError(f"behave_mode must be one of {BEHAVE_MODES}, got {self.behave_mode!r}")
        if not self.behave_cap >= 1:
            raise ValueError(f"behave_cap must be >= 1, got {self.behave_cap}")


@dataclass(frozen=True)
class PipelineConfig:
    """One run. Each step trains `groups_per_step` groups of `group_size` completions of one prompt.
    `eta`: the most versions a trained sample's oldest token may lag the weights that train on it
    (0: synchronous on-policy). Timeouts bound every wait (a stalled weight sync or call raises
    PipelineTimeout instead of hanging)."""
    steps: int
    groups_per_step: int = 8
    group_size: int = 8
    eta: int = 1
    producers: int = 1
    groups_per_call: int = 4  # groups a producer leases and generates in one engine call
    seed: int = 0
    lr: float = 1e-3
    grad_clip: float = 1.0
    state_sharding: str = "fsdp2"
    impl: dict = field(default_factory=dict)
    sampling: Sampling = field(default_factory=Sampling)
    objective: Objective = field(default_factory=Objective)
    take_timeout_s: float = 600.0  # the trainer waiting for a step's groups
    weight_timeout_s: float = 600.0  # a producer waiting for weights new enough to be admitted
    call_timeout_s: float = 600.0  # any other remote call
    threads: int = 1  # torch threads per actor
    producer_cpus: float = 1.0
    trainer_cpus: float = 1.0
    restarts: int = 1  # producer restarts allowed over the run
    weights: str = "object_store"  # the weight channel: "object_store" (Ray's) or "p2p" (the primitive)
    publish_in_background: bool = True  # object_store: the trainer snapshots its export (a device copy, a pinned
    # host buffer on CUDA) and trains on while a thread puts it in the store; False: the step waits for the put
    trainer_ranks: int = 1  # data-parallel ranks of the trainer (one actor each, FSDP2/ZeRO-1 over their ranks)
    expert_parallel: int = 1  # an MoE model's experts split over this many trainer ranks (divides trainer_ranks)
    producer_gpus: float = 0.0  # Ray's num_gpus per producer actor (0: CPU); its engine on the GPU Ray assigns
    trainer_gpus: float = 0.0  # Ray's num_gpus per trainer rank (0: CPU); its runtime on the GPU Ray assigns
    warmup: bool = False  # before the first step: every trainer rank runs a step's calls training nothing
    # (`trainer.warmup_step`), every producer takes the first weights and makes one throwaway engine call;
    # the run's samples and updates are unchanged, its first step no longer holds the processes' first calls

    def __post_init__(self):
        for name in ("steps", "groups_per_step", "group_size", "producers", "groups_per_call", "threads",
                     "trainer_ranks", "expert_parallel"):
            _positive(name, getattr(self, name))
        if self.weights not in WEIGHT_CHANNELS:
            raise ValueError(f"weights must be one of {WEIGHT_CHANNELS}, got {self.weights!r}")
        for name in ("publish_in_background", "warmup"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.weights == "p2p" and self.restarts:
            raise ValueError("restarts must be 0 with weights='p2p': a dead rank breaks the transfer's group "
                             "(the object_store channel survives restarts)")
        if self.trainer_ranks % self.expert_parallel:
            raise ValueError(f"expert_parallel must divide trainer_ranks, got expert_parallel={self.expert_parallel} "
                             f"with trainer_ranks={self.trainer_ranks}")
        for name in ("producer_gpus", "trainer_gpus", "producer_cpus", "trainer_cpus"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        whole = [float(g).is_integer() and g >= 1 for g in (self.producer_gpus, self.trainer_gpus)]
        if self.weights == "p2p" and (self.producer_gpus or self.trainer_gpus) and not all(whole):
            raise ValueError(f"weights='p2p' on GPUs needs producer_gpus and trainer_gpus both whole GPUs (>= 1 each), "
                             f"got producer_gpus={self.producer_gpus!r}, trainer_gpus={self.trainer_gpus!r}: its NCCL "
                             f"ranks cannot share a GPU (a fraction) nor mix with CPU ranks; set both to 0 (gloo) "
                             f"or use weights='object_store'")
        if not (isinstance(self.eta, int) and self.eta >= 0):
            raise ValueError(f"eta must be an int >= 0, got {self.eta!r}")
        for name in ("take_timeout_s", "weight_timeout_s", "call_timeout_s", "lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def trainer_timeout_s(self) -> float:
        """How long a trainer rank waits in a collective of any group the pipeline makes over the
        trainer's ranks (the trainer ranks' own, its (efsdp, ep) mesh's): a step's ranks wait on rank
        0's take of the step's groups, then on one remote call either side of it."""
        return self.take_timeout_s + 2 * self.call_timeout_s


def _positive(name, value):
    if not (isinstance(value, int) and value > 0):
        raise ValueError(f"{name} must be an int > 0, got {value!r}")


class PipelineTimeout(TimeoutError):
    """A wait of the pipeline passed its limit (a stalled weight sync, producer or remote call)."""
