"""Learning-rate schedules and per-step AdamW hyperparameters on a TrainState's optimizer.

The schedules are transformers' (and verl's) multiplicative factors of the base learning rate, by
scheduler step s (0 before the first `lr_scheduler_step`):
- "constant":        1
- "linear_warmup":   s / W during the W warm-up steps, then 1   (get_constant_schedule_with_warmup)
- "linear":          warm-up, then linearly down to min_lr_ratio at total_steps (get_linear_schedule_with_warmup
                     when min_lr_ratio = 0)
- "cosine":          warm-up, then half a cosine down to min_lr_ratio at total_steps
                     (get_cosine_with_min_lr_schedule_with_warmup; num_cycles = 0.5)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("constant", "linear_warmup", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    name: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None  # "linear" and "cosine": the step where the decay ends
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5

    def __post_init__(self):
        if self.name not in SCHEDULES:
            raise ValueError(f"LRSchedule name must be one of {SCHEDULES}, got {self.name!r}")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise ValueError(f"LRSchedule warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if self.name == "constant" and self.warmup_steps:
            raise ValueError("LRSchedule 'constant' has no warm-up: use 'linear_warmup' for warmup_steps > 0")
        if self.name in ("linear", "cosine") and not (isinstance(self.total_steps, int)
                                                      and self.total_steps > self.warmup_steps):
            raise ValueError(f"LRSchedule {self.name!r} needs total_steps (an int) > warmup_steps="
                             f"{self.warmup_steps}, got {self.total_steps!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"LRSchedule min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")

    def factor(self, step: int) -> float:
        """The learning rate's multiple of the base at scheduler step `step`."""
        if self.name == "constant":
            return 1.0
        if step < self.warmup_steps:
            return step / max(1, self.warmup_steps)
        if self.name == "linear_warmup":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        if self.name == "linear":
            decay = 1.0 - progress
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * self.num_cycles * 2.0 * progress))
        return max(0.0, self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay)


def check_adam(lr=None, betas=None, eps=None, weight_decay=None) -> dict:
    """The given AdamW hyperparameters (None: unchanged), checked; ValueError names the bad one."""
    out = {}
    if lr is not None:
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
            raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
        out["lr"] = float(lr)
    if betas is not None:
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        out["betas"] = tuple(float(b) for b in betas)
    if eps is not None:
        if not (isinstance(eps, (int, float)) and eps > 0):
            raise ValueError(f"eps must be a number > 0, got {eps!r}")
        out["eps"] = float(eps)
    if weight_decay is not None:
        if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
            raise ValueError(f"weight_decay must be a number >= 0, got {weight_decay!r}")
        out["weight_decay"] = float(weight_decay)
    return out


def base_lr(optimizer) -> float:
    """The learning rate a schedule scales: each param group's "initial_lr" (torch LRScheduler's key),
    taken from its "lr" the first time asked. A schedule then sets "lr" (0 at the start of a warm-up),
    so a Runtime built later on the same optimizer still finds the rate it was built with."""
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return optimizer.param_groups[0]["initial_lr"]


def set_hyperparameters(optimizer, **hp) -> None:
    for group in optimizer.param_groups:
        group.update(hp)


def hyperparameters(optimizer) -> dict:
    g = optimizer.param_groups[0]
    return {"lr": g["lr"], "betas": tuple(g["betas"]), "eps": g["eps"], "weight_decay": g["weight_decay"]}
