"""Hydra config entries for verl 0.9.1's trainers that select bumblebee's engine for the actor and
the reference model: add `hydra.searchpath=[pkg://bumblebee.integrations.verl_config]` and
`model_engine=bumblebee` to a verl command line (see skills/rl-smoke/SKILL.md)."""
