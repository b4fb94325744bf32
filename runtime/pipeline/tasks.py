"""Prompt sources with rule rewards. A task is a dataset iterator of (prompt tokens, meta) and a
`reward(meta, completion tokens) -> float`; producers score their own completions."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator, Protocol


class Task(Protocol):
    pad_id: int
    eos_id: int | None

    def prompts(self, seed: int) -> Iterator[tuple[list[int], dict]]: ...

    def reward(self, meta: dict, tokens: list[int]) -> float: ...


@dataclass(frozen=True)
class CopyDigits:
    """Copy `length` random digits: prompt BOS d1..dn SEP, answer d1..dn (token ids 0-9 are the
    digits); the reward is the fraction of answer tokens equal to the prompt's digits in place."""
    length: int = 3
    bos_id: int = 10
    sep_id: int = 11
    pad_id: int = 12
    eos_id: int | None = None  # answers are exactly max_new_tokens long

    def prompts(self, seed: int):
        rng = random.Random(seed)
        while True:
            digits = [rng.randrange(10) for _ in range(self.length)]
            yield [self.bos_id, *digits, self.sep_id], {"digits": digits}

    def reward(self, meta: dict, tokens: list[int]) -> float:
        digits = meta["digits"]
        return sum(int(a == b) for a, b in zip(tokens, digits)) / len(digits)
