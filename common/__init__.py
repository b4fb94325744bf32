"""What a slot's primitive and its baseline twin both use and neither owns: the parameters that keep
their state_dicts identical, the plain steps (token sort, permutation) that are not what the pair
compares. Each file is named after its slot (`<slot>_*.py`) and imports only torch and the core."""
