"""`naive_patch`: each device denoises its patch as if it were the whole image (zero padding,
local GroupNorm, local attention); no communication inside the UNet, visible seams.
DistriFusion's baseline (Li et al. 2024, Table 1, "naive patch")."""

from dataclasses import dataclass

from patchpar.parallel.strategies.base import Strategy, option

SPLITS = ("row", "col", "alternate")


@dataclass(frozen=True)
class NaivePatch(Strategy):
    name = "naive_patch"
    split: str = option(
        "row",
        "row (default), col or alternate (row on even steps, col on odd; DistriFusion Fig. 3's "
        "baselines).",
    )

    def __post_init__(self):
        if self.split not in SPLITS:
            raise ValueError(f"split={self.split!r}; known: {list(SPLITS)}")

    def patch_axis(self, step_parity: int) -> str:
        if self.split == "alternate":
            return "row" if step_parity == 0 else "col"
        return self.split
