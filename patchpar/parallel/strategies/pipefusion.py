"""`pipefusion`: PipeFusion (xDiT, arXiv 2405.14430), displaced patch pipeline parallelism for a
DiT. The blocks are split into stages over the patch axis (1/S of the block weights per device),
the latent into M >= S row patches streamed through the stages; each stage attends over a
full-image K/V buffer of its own layers, fresh for the patches it has computed this step and
one step stale for the rest. Only activations hop between stages (one patch's tokens per slot),
not every layer's K/V as in patch parallelism. Owns its program (`patchpar.parallel.pipeline`);
the first `warmup_steps` steps are exact full-image passes (xDiT's `warmup_steps`)."""

from dataclasses import dataclass

from patchpar.parallel.strategies.base import Strategy, option


@dataclass(frozen=True)
class PipeFusion(Strategy):
    name = "pipefusion"

    warmup_steps: int = option(
        1,
        "the first warmup_steps steps are exact full-image passes through the stages, which "
        "fill the K/V buffers (xDiT's warmup_steps, default 1; at least 1).",
    )
    num_patches: int | None = option(
        None,
        "M, the row patches streamed through the S stages (xDiT's num_pipeline_patch; default "
        "M = S, the devices on the patch axis); M >= S.",
    )

    def program(self):
        from patchpar.parallel.pipeline import PIPELINE

        return PIPELINE

    def patches(self, stages: int) -> int:
        """M on `stages` devices."""
        return stages if self.num_patches is None else self.num_patches

    def warmup_phase_steps(self, steps: int) -> int:
        return min(steps, self.warmup_steps)

    def phase_iterations(self, phase: str, steps: int, patch: int) -> int:
        # the steady loop drains the pipeline in one more period (S - 1 slots of it used)
        return steps + (phase == "steady" and patch > 1 and steps > 0)

    def validate(self, steps: int, patch: int, cfg: int) -> None:
        w, m = self.warmup_steps, self.num_patches
        if not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= steps:
            raise ValueError(
                f"pipefusion: warmup_steps={w!r} must be an integer in [1, steps={steps}]: the "
                f"first full-image pass fills the K/V buffers the pipelined steps read"
            )
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < patch):
            raise ValueError(
                f"pipefusion: num_patches={m!r} must be an integer >= the {patch} stage(s): a "
                f"latent patch comes back to the first stage S - 1 slots after it left, and is "
                f"needed M slots after; use num_patches >= {patch} (default {patch})"
            )

    def validate_layers(self, layers: int, rows: int, p: int, why: str, patch: int) -> None:
        """`layers` blocks on `patch` stages, latent `rows` into num_patches patches of whole
        tokens (rows a multiple of p, for `why`)."""
        if layers < patch:
            raise ValueError(
                f"pipefusion: {layers} blocks cannot fill {patch} stages (every device needs at "
                f"least one block); use at most {layers} devices on the patch axis"
            )
        m = self.patches(patch)
        if rows % (m * p):
            fits = [k for k in range(patch, rows // p + 1) if rows % (k * p) == 0]
            raise ValueError(
                f"pipefusion: latent rows={rows} do not split into num_patches={m} patches of "
                f"whole tokens ({why}: {m} x {p} = {m * p} rows); "
                + (
                    f"num_patches can be one of {fits} on {patch} stages"
                    if fits
                    else f"fewer stages, or a latent height that is a multiple of {m * p}"
                )
            )
