"""Reference twins: plain, obviously-correct implementations of every slot."""
from bumblebee.baselines import attention, cross_entropy, linear_attention, mla, moe_dispatch, mtp, router, state_sharding, weight_transfer  # noqa: F401  (registers the slots)
