"""`asyncdiff`: AsyncDiff (Chen et al., NeurIPS 2024, arXiv 2406.06911), asynchronous denoising
by model parallelism. The denoiser's blocks are split into S components balanced by FLOPs; after
`warmup_steps` exact steps, component k > 0 runs on component k-1's output of the step (stride
1) or round (stride 2) before, so the S components run at once; the last one's output is the
prediction, which the first device turns into the next latent. Stride 1: one component per
device of the patch axis, every step. Stride 2 (the paper's stride denoising): S components on
S + 1 devices, one round per two steps: devices 0..S-1 run the components on the next step's
timestep, device S runs the last component again on this step's, so a round gives both steps'
predictions. Every device holds the whole model and the whole image (no row patches), as in
the released code. Owns its program (`patchpar.parallel.asyncdiff`). Runs on every family
whose forward is prologue, blocks and epilogue: UNets (down, mid and up blocks; the skip
connections travel with the activation), PixArt, SD3, FLUX.1."""

from dataclasses import dataclass

from patchpar.parallel.strategies.base import Strategy, option

STRIDES = (1, 2)


@dataclass(frozen=True)
class AsyncDiff(Strategy):
    name = "asyncdiff"

    warmup_steps: int = option(
        9,
        "the first warmup_steps steps run the whole model on every device, exactly (the "
        "released code's warm_up, 9 of 50 steps in its examples; at least 1: the first "
        "asynchronous step reads each component's output of the step before).",
    )
    stride: int = option(
        1,
        "1: S components on S devices, one asynchronous step at a time; 2: the paper's stride "
        "denoising, S components on S + 1 devices (S >= 2), each asynchronous round (an odd "
        "step, as in the released code) giving the predictions of two steps.",
        quiet=True,
    )

    def program(self):
        from patchpar.parallel.asyncdiff import ASYNC

        return ASYNC

    def components(self, patch: int) -> int:
        """The components on a patch axis of `patch` devices."""
        return patch - (self.stride - 1)

    def warmup_phase_steps(self, steps: int) -> int:
        return min(steps, self.warmup_steps)

    def phase_iterations(self, phase: str, steps: int, patch: int) -> int:
        del patch
        if phase != "steady" or self.stride == 1:
            return steps
        # the model runs on the odd steps of [warmup_steps, warmup_steps + steps)
        w = self.warmup_steps
        return (w + steps) // 2 - w // 2

    def validate(self, steps: int, patch: int, cfg: int) -> None:
        w, stride = self.warmup_steps, self.stride
        if not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= steps:
            raise ValueError(
                f"asyncdiff: warmup_steps={w!r} must be an integer in [1, steps={steps}]: the "
                f"first asynchronous step reads each component's output of an exact step "
                f"before it; use warmup_steps between 1 and {steps}"
            )
        if stride not in STRIDES or isinstance(stride, bool):
            raise ValueError(f"asyncdiff: stride={stride!r}; known: {list(STRIDES)}")
        if stride == 2 and patch < 3:
            raise ValueError(
                f"asyncdiff: stride=2 runs S >= 2 components on S + 1 devices (the last "
                f"component twice, for this step and the next); {patch} device(s) on the "
                f"patch axis: use at least 3, or stride=1"
            )
