"""`single`: the whole latent on one device; the reference every other strategy is judged by."""

from dataclasses import dataclass

from patchpar.parallel.strategies.base import Strategy


@dataclass(frozen=True)
class Single(Strategy):
    name = "single"
    parallel = False

    def validate(self, steps: int, patch: int, cfg: int) -> None:
        if patch * cfg != 1:
            raise ValueError(
                f"strategy 'single' runs on 1 device, got devices={patch * cfg}; pick a parallel strategy"
            )
