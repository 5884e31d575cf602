"""`asyncdiff`: AsyncDiff (Chen et al., NeurIPS 2024, arXiv 2406.06911), asynchronous denoising
by model parallelism. The denoiser's blocks are split into S components, one per device of the
patch axis, balanced by FLOPs; after `warmup_steps` exact steps, component k > 0 runs at step t
on component k-1's output of step t-1, so the S components of a step run at once; the last
one's output is the step's prediction, which the first device turns into the next latent.
Every device holds the whole model and the whole image (no row patches), as in the released
code. Owns its program (`patchpar.parallel.asyncdiff`). Runs on every family whose forward is
prologue, blocks and epilogue: UNets (down, mid and up blocks; the skip connections travel
with the activation), PixArt, SD3, FLUX.1. The paper's stride-2 mode is not built."""

from dataclasses import dataclass

from patchpar.parallel.strategies.base import Strategy, option


@dataclass(frozen=True)
class AsyncDiff(Strategy):
    name = "asyncdiff"

    warmup_steps: int = option(
        9,
        "the first warmup_steps steps run the whole model on every device, exactly (the "
        "released code's warm_up, 9 of 50 steps in its examples; at least 1: the first "
        "asynchronous step reads each component's output of the step before).",
    )

    def program(self):
        from patchpar.parallel.asyncdiff import ASYNC

        return ASYNC

    def warmup_phase_steps(self, steps: int) -> int:
        return min(steps, self.warmup_steps)

    def validate(self, steps: int, patch: int, cfg: int) -> None:
        w = self.warmup_steps
        if not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= steps:
            raise ValueError(
                f"asyncdiff: warmup_steps={w!r} must be an integer in [1, steps={steps}]: the "
                f"first asynchronous step reads each component's output of an exact step "
                f"before it; use warmup_steps between 1 and {steps}"
            )
