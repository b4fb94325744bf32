"""Fast swap-in implementations of the slots."""
from bumblebee.primitives import attention, cross_entropy, linear_attention, mla, moe_dispatch, mtp, router, state_sharding, weight_transfer  # noqa: F401  (registers the slots)
