"""Fast swap-in implementations of the slots."""
from bumblebee.primitives import attention, router  # noqa: F401  (registers the slots)
