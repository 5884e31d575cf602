"""`pipefusion`: PipeFusion (xDiT, arXiv 2405.14430), displaced patch pipeline parallelism for a
DiT. The blocks are split into stages over the patch axis (1/S of the block weights per device),
the latent into M >= S row patches streamed through the stages; each stage attends over a
full-image K/V buffer of its own layers, fresh for the patches it has computed this step and
one step stale for the rest. Only activations hop between stages (one patch's tokens per slot),
not every layer's K/V as in patch parallelism. An MMDiT (FLUX.1) runs its double- and
single-stream blocks as two segments, each split over the stages, the second back from the
last stage to the first; each patch carries its own text stream with its image tokens. Owns
its program (`patchpar.parallel.pipeline`); the first `warmup_steps` steps are exact
full-image passes (xDiT's `warmup_steps`)."""

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
        "M = S, the devices on the patch axis); M >= S. A model of two kinds of blocks (FLUX.1: "
        "double-, then single-stream) runs them as two segments, the second back from stage "
        "S-1 to 0, so M >= 2(S-1)+1 (default: the least such M that splits the token rows, "
        "else the least M). Where M does not divide the token rows, the patches are as even "
        "as the rows allow, each computed padded to the largest.",
    )

    def program(self):
        from patchpar.parallel.pipeline import PIPELINE

        return PIPELINE

    def patches(self, stages: int, segments: int = 1, token_rows: int | None = None) -> int:
        """M on `stages` devices for a stack of `segments` segments: num_patches, or by
        default the fewest that keep the pipeline full (segments x (S - 1) + 1: a patch's
        new latent is back on device 0 that many slots after it left; S for one segment),
        and with more segments the least of those that splits `token_rows`."""
        if self.num_patches is not None:
            return self.num_patches
        least = segments * (stages - 1) + 1
        if segments == 1 or token_rows is None:
            return least
        return next((m for m in range(least, token_rows + 1) if token_rows % m == 0), least)

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

    def validate_layers(
        self, layers: tuple[int, ...], rows: int, p: int, why: str, patch: int
    ) -> None:
        """Segments of `layers` blocks each on `patch` stages, latent `rows` into num_patches
        patches of whole tokens (rows a multiple of p, for `why`; as evenly as they go where
        num_patches does not divide them)."""
        if min(layers) < patch:
            raise ValueError(
                f"pipefusion: {min(layers)} blocks cannot fill {patch} stages (every device "
                f"needs at least one block of each kind: {list(layers)}); use at most "
                f"{min(layers)} devices on the patch axis"
            )
        segments = len(layers)
        m = self.patches(patch, segments, rows // p)
        least = segments * (patch - 1) + 1
        if m < least:
            raise ValueError(
                f"pipefusion: num_patches={m} on {patch} stages of a model with {segments} "
                f"kinds of blocks: a patch comes back to the first stage {least - 1} slots "
                f"after it left and is needed M slots after; use num_patches >= {least}"
            )
        if rows % p:
            raise ValueError(
                f"pipefusion: latent rows={rows} are not whole token rows ({why}: a multiple "
                f"of {p}); use a latent height that is a multiple of {p}"
            )
        if rows // p < m:  # uneven patches where M does not divide them, each a token row
            raise ValueError(
                f"pipefusion: latent rows={rows} are {rows // p} token rows ({why}), fewer "
                f"than num_patches={m}, each of which needs at least one; use a latent of at "
                f"least {m * p} rows, or fewer patches"
            )
