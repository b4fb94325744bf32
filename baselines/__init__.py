"""Reference twins: plain, obviously-correct implementations of every slot."""
from bumblebee.baselines import attention, cross_entropy, moe_dispatch, router  # noqa: F401  (registers the slots)
