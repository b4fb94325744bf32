"""Reference twins: plain, obviously-correct implementations of every slot."""
from bumblebee.baselines import attention, cross_entropy, mla, moe_dispatch, mtp, router  # noqa: F401  (registers the slots)
