"""The `sampling` section of a recipe: how the next token is chosen (greedy when temperature == 0)."""

from __future__ import annotations

import dataclasses

from dflash.configs.schema import require


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. temperature 0 is greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        require(self.temperature >= 0.0, "sampling.temperature", self.temperature, "be >= 0")
        require(0.0 < self.top_p <= 1.0, "sampling.top_p", self.top_p, "lie in (0, 1]")
        require(self.top_k >= 0, "sampling.top_k", self.top_k, "be >= 0 (0 disables top-k)")
        require(self.max_new_tokens >= 1, "sampling.max_new_tokens", self.max_new_tokens, "be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


__all__ = ["SamplingConfig"]
