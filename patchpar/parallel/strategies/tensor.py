"""`tensor`: Megatron-style tensor parallelism, the released DistriFusion's "sync tensor
parallel" baseline (Li et al. 2024, Table 2). The weights of every attention (heads), GEGLU
feed-forward (inner width) and ResNet block (middle channels, with norm2's groups) are split
over the `model` mesh axis by the `tensor` logical-axis rules (`parallel.rules`); each row-split
output (to_out, net.2, conv2) is all-reduced over the axis (`pp_tp`). Everything else runs
whole on every device. With `tp_degree` below the devices an image has, the rest form a patch
axis with `sync_patch`'s exact sites (a hybrid). The output equals `single`."""

from dataclasses import dataclass

from patchpar.parallel.mesh import divisors
from patchpar.parallel.sites import PatchOps, patch_ops
from patchpar.parallel.strategies.base import Strategy, option


@dataclass(frozen=True)
class Tensor(Strategy):
    name = "tensor"
    rules = "tensor"
    tp_degree: int | None = option(
        None,
        "devices each layer's weights are split over (diffusers' tp_degree; default: all of an "
        "image's devices); must divide the block widths and the GroupNorm groups (heads that do "
        "not divide are padded with zero heads). Below the devices an image has, the rest are "
        "exact row patches (a hybrid).",
    )

    def model_degree(self, devices: int) -> int:
        return devices if self.tp_degree is None else self.tp_degree

    def validate_mesh(self, devices: int) -> None:
        tp = self.tp_degree
        if tp is not None and (not isinstance(tp, int) or tp < 1 or devices % tp):
            raise ValueError(
                f"tensor: tp_degree={tp!r} must divide the {devices} devices an image has "
                f"(devices / (data x cfg)); one of {divisors(devices)}"
            )

    def ops(self, phase: str, n: int) -> PatchOps:
        del phase
        return patch_ops(n)
