"""Runs a denoiser (a UNet or a DiT) under a strategy: one `shard_map` program per phase over
the (data, cfg, patch, model) mesh.

Per device the UNet sees its share of the images (`data`), a row (or column) slab of their
latents (`patch`) and its share of the guidance batch (`cfg`); the site ops of the strategy's
phase do the exchanges. Stale buffers leave the shard_map as global arrays with leading
(data, cfg, patch) device axes, so the denoising loop carries them explicitly from step t to
step t+1. The latent stays sharded across steps (the scheduler update is elementwise); with
`cfg=2` the two guidance halves meet by an all-gather over `cfg`. Images never meet: the data
axis has no collective, and image (prompt p, seed s) is the same whatever the split, since its
initial latent is drawn from its own key before any sharding. Parameters enter placed by the
plan's logical-axis rules (`parallel.rules`): whole, split over `model` (tensor parallel), and
with `fsdp` sharded over the rest, each layer gathering its own as it runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache, partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from patchpar.models.family import Denoiser
from patchpar.parallel.checks import check_scan_plan, site_kinds, uneven_supported
from patchpar.parallel.exchange import check_groups
from patchpar.parallel.mesh import divisors, make_mesh, mesh_shape
from patchpar.parallel.program import Program
from patchpar.parallel.rules import (
    FSDP_AXES,
    RULES,
    check_sharded,
    weight_bytes_per_device,
)
from patchpar.parallel.sites import (
    param_shapes,
    shapes_only,
)
from patchpar.parallel.split import (
    UNEVEN_COMPUTE,
    fmt,
    is_even,
    pad_rows,
    split_rows,
    unpad_rows,
)
from patchpar.parallel.step import make_step
from patchpar.parallel.strategies import Strategy
from patchpar.sampling.cache import StepCache
from patchpar.sampling.experts import Experts
from patchpar.sampling.guidance import Conditioning
from patchpar.sampling.loop import run_steps
from patchpar.sampling.schedulers import Sampler, Schedule


@dataclass(frozen=True)
class Plan:
    """A strategy placed on devices: `devices` = data x cfg x patch x model (the model degree
    is the strategy's: `tensor` splits weights over it, the others keep it 1)."""

    strategy: Strategy
    devices: int = 1
    cfg: int = 1
    comm: bool = True
    """False: every collective is a local stand-in of the same shape (`PatchOps.with_stand_ins`):
    wrong images, but the time is each device's compute alone (DistriFusion Table 2's
    "no communication (ideal)" row). Static, so such programs never share a jit cache entry."""
    data: int = 1
    """Devices that split the images of a batch (data parallel); each image stays whole on
    its data slice."""
    fsdp: bool = False
    """Shard every weight's `embed` dimension over the devices that run the same weights
    (data x cfg x patch) and gather it per layer as the layer runs (ZeRO-3 / FSDP): weight
    memory per device / that degree, for an all-gather of every layer per UNet call."""
    cache: StepCache | None = None
    """A step cache (`patchpar.sampling.cache`): reuse across steps, inside each device's
    program; None: every step runs every block."""
    patch_weights: tuple[float, ...] | None = None
    """Each patch device's share of the latent rows (`parallel.split`), in order; None: equal
    shares (an even split where the rows divide, else the most even one)."""

    uneven_compute: str = "auto"
    """Uneven patches: `own`, each device computes its own rows alone where no collective runs
    inside the model call (the packed steady phase of a stale strategy); `padded`, every
    device computes the largest patch's rows (what every phase with a collective inside does);
    `auto`, own where patch weights are given (devices of different speeds), padded on the
    most even split (equal devices: the largest patch sets the pace either way)."""
    stale_exchange: bool = True
    """False (with `comm=False`): stale exchanges left out, sends returned (`SEND` in the state),
    buffers kept as given: a program beside exchanges that overlap it on the interconnect."""

    def __post_init__(self):
        if self.comm and not self.stale_exchange:
            raise ValueError("stale_exchange=False (exchanges left out) needs comm=False")
        if self.uneven_compute not in UNEVEN_COMPUTE:
            known = list(UNEVEN_COMPUTE)
            raise ValueError(f"uneven_compute={self.uneven_compute!r}; known: {known}")
        if self.patch_weights is not None:  # hashable: a plan is a static jit argument
            object.__setattr__(self, "patch_weights", tuple(self.patch_weights))

    def row_split(self, rows: int, unet: Denoiser) -> tuple[int, ...]:
        """The latent rows of each patch of a latent of `rows` rows (`split.split_rows`): whole
        units of the denoiser's row multiple, evenly where they divide and no weights are
        given; a ValueError where they cannot be split."""
        n, unit = self.patch, unet.row_multiple
        if self.patch_weights is None and rows % (n * unit) == 0:
            return (rows // n,) * n
        return split_rows(rows, n, unit, self.patch_weights, unet.row_multiple_reason)

    @property
    def splits_row_patches(self) -> bool:
        """Whether its program splits the latent into row patches over several devices (not:
        one patch device, column patches, a program that does not split rows)."""
        axes = {self.strategy.patch_axis(0), self.strategy.patch_axis(1)}
        return self.patch > 1 and self.program.splits_rows and axes == {"row"}

    def patch_rows(self, rows: int, unet: Denoiser) -> tuple[int, ...] | None:
        """The rows of each patch where this plan splits a latent of `rows` rows into row
        patches (None: it does not)."""
        return self.row_split(rows, unet) if self.splits_row_patches else None

    def split_note(self, rows: int, unet: Denoiser) -> str | None:
        """One line saying how an uneven split of a latent of `rows` rows falls (None: even)."""
        return self.program.split_note(self, unet, rows)

    @property
    def own_rows(self) -> bool:
        """Whether uneven patches compute their own rows where they can (`uneven_compute`)."""
        return self.uneven_compute == "own" or (
            self.uneven_compute == "auto" and self.patch_weights is not None
        )

    @property
    def model(self) -> int:
        return self.strategy.model_degree(self.devices // (self.cfg * self.data))

    @property
    def program(self) -> Program:
        """How its phases are built and run: the strategy's own program, or the engine's
        (`STEP`: one model call per step with the strategy's site ops)."""
        return self.strategy.program() or STEP

    @property
    def patch(self) -> int:
        return self.devices // (self.cfg * self.data * self.model)

    def degrees(self) -> dict[str, int]:
        """{mesh axis: degree}."""
        return mesh_shape(self.devices, self.cfg, self.data, self.model)

    def mesh(self) -> Mesh:
        return make_mesh(self.devices, self.cfg, self.data, self.model)

    @property
    def fsdp_degree(self) -> int:
        """Devices each weight is sharded over at rest (1: none)."""
        degrees = self.degrees()
        return math.prod(degrees[a] for a in FSDP_AXES) if self.fsdp else 1

    def rules(self) -> dict:
        """Logical-axis rules placing the parameters (`patchpar.parallel.rules`): the
        strategy's, and with `fsdp` the FSDP rule over the axes of degree > 1."""
        rules = dict(RULES[self.strategy.rules])
        if self.fsdp_degree > 1:
            degrees = self.degrees()
            for name, axes in RULES["fsdp"].items():
                rules[name] = tuple(a for a in axes if degrees[a] > 1)
        return rules

    @property
    def rules_name(self) -> str:
        """`replicated`, `tensor`, `fsdp` or `tensor+fsdp` (FSDP of degree 1 is nothing);
        `stages` for a pipeline (each device its stage's blocks)."""
        if self.program.rules_name is not None:
            return self.program.rules_name
        if self.fsdp_degree == 1:
            return self.strategy.rules
        return "fsdp" if self.strategy.rules == "replicated" else f"{self.strategy.rules}+fsdp"

    def validate(
        self,
        unet: Denoiser,
        latent_hw: tuple[int, int],
        steps: int,
        guidance_scale: float,
        batch: int | None = None,
        build_mesh: bool = True,
    ) -> None:
        """All checks up front; ValueError naming the numbers and what would fit. `batch`:
        the images per call (they must split evenly over `data`). `build_mesh=False`: the
        devices are elsewhere (launched processes), the mesh is not built here."""
        s = self.strategy
        mesh_shape(self.devices, self.cfg, self.data)  # data and cfg degrees
        if self.patch_weights is not None and not self.splits_row_patches:
            raise ValueError(
                f"patch_weights={fmt(self.patch_weights)}: strategy "
                f"{s.name!r} on {self.patch} patch device(s) does not split the rows into row "
                f"patches (one patch device, column patches, or a program of its own), so there "
                f"are no rows to weigh; leave patch_weights unset"
            )
        s.validate_mesh(self.devices // (self.cfg * self.data))  # the strategy's model degree
        if build_mesh:
            make_mesh(self.devices, self.cfg, self.data, self.model)  # and the devices present
        unet.check_split(self.model)
        if self.model > 1 and getattr(unet.module, "quant_activations", False):
            raise ValueError(
                f"tensor parallelism over {self.model} devices splits a row-parallel layer's "
                f"inputs, so a quantized activation's per-token scale would be each device's "
                f"share's, not the token's (quant={unet.module.quant_mode!r}): use a weight-only "
                f"mode (w8, w4) with tensor parallelism"
            )
        if self.fsdp_degree > 1:
            check_sharded(param_shapes(unet), self.rules(), self.degrees(), unet.logical)
        if not s.parallel and self.devices != 1:
            raise ValueError(
                f"strategy {s.name!r} runs on 1 device, got devices={self.devices} (data="
                f"{self.data}, cfg={self.cfg}); pick a parallel strategy (sync_patch with "
                f"devices = data is pure data parallelism)"
            )
        s.validate(steps, self.patch, self.cfg)
        if batch is not None and batch % self.data:
            raise ValueError(
                f"batch of {batch} image(s) per call is not divisible by data={self.data}: every "
                f"data slice takes the same number of images; use a multiple of {self.data} "
                f"images per call, or data in {divisors(batch)}"
            )
        if self.cfg == 2 and not guidance_scale > 1:
            raise ValueError(
                f"cfg=2 puts the unconditional and conditional halves on different devices, but "
                f"guidance_scale={guidance_scale} turns guidance off; use cfg=1 or guidance_scale > 1"
            )
        self.program.validate(self, unet, tuple(latent_hw), build_mesh)
        check_scan_plan(self, unet)
        if self.cache is not None:
            self.cache.validate(unet, steps)
            if self.program.no_cache:
                raise ValueError(
                    f"cache {self.cache.name!r} with strategy {s.name!r}: not defined; a cache "
                    f"decides per step on the whole image's activations or output, and "
                    f"{s.name}'s program ({self.program.name}): {self.program.no_cache}; use "
                    f"it with the one-call strategies (single, sync_patch, distrifusion, pcpp, "
                    f"compact, ...)"
                )
            if s.patch_axis(0) != s.patch_axis(1):
                raise ValueError(
                    f"cache {self.cache.name!r} with {s.describe()}: not defined; its steps "
                    f"alternate row and column patches, so what a cache keeps from one step (a "
                    f"residual, an output) is another slab than the next step's; use split=row "
                    f"or split=col"
                )


class StepProgram(Program):
    """The engine's program: each step one call of the denoiser under `shard_map` over the
    (data, cfg, patch, model) mesh, the strategy's site ops doing the exchanges."""

    name = "step"

    def validate(self, plan, unet, latent_hw, build_mesh=True) -> None:
        s = plan.strategy
        text = getattr(s, "text", "own")
        if text != "own" and not unet.text_stream:
            raise ValueError(
                f"{s.name}: text={text!r} says how an MMDiT keeps its text stream; a "
                f"{unet.family} has none (its text enters by cross-attention): use text=own"
            )
        if s.patch_axis(0) == s.patch_axis(1) == "row":  # a split there is; what pads, said
            rows = plan.row_split(latent_hw[0], unet)  # first (a trace below would fail on it)
            if not is_even(rows):
                uneven_supported(plan, rows)
            if not hasattr(s.ops("warmup", plan.patch), "with_rows"):  # slabs run alone:
                unet.as_patch(tuple(rows))  # a video's must be whole videos of their own
        if build_mesh and (groups := s.packed_groups()) is not None and groups > 1:
            check_groups(groups, stale_sites(unet, plan, tuple(latent_hw)))
        if (coded := s.coded()) is not None:  # a wire or codec names only sites the model has
            coded.check(site_kinds(unet), f"a {unet.family} denoiser")
        down = unet.row_multiple
        axes = {s.patch_axis(0), s.patch_axis(1)}
        if "col" in axes and not unet.splits_columns:
            raise ValueError(
                f"strategy {s.name!r} splits columns, but a {unet.family} transformer's positions "
                f"are split by rows only; use split=row"
            )
        if "col" in axes:  # column patches split evenly
            mult = plan.patch * down
            for axis in sorted(axes):
                size = latent_hw[0] if axis == "row" else latent_hw[1]
                if size % mult or plan.patch_weights is not None:
                    what = "rows" if axis == "row" else "columns"
                    raise ValueError(
                        f"latent {what}={size} with split={getattr(s, 'split', 'col')!r}: "
                        f"column patches split evenly (patch={plan.patch} x {unet.row_multiple_reason} = {mult} must "
                        f"divide both sides, and patch weights are for row patches); use a "
                        f"latent size that is a multiple of {mult}, or split=row"
                    )

    def place(self, plan, unet, params):
        # placed inside the program by the logical-axis rules (`parallel.rules`); a scanned
        # stack's blocks stacked here, once (`Denoiser.prepare`)
        return unet.prepare(params)

    def weight_bytes(self, plan, unet, params) -> int:
        return weight_bytes_per_device(params, plan.rules(), plan.degrees(), unet.logical)

    def run_phase(self, unet, plan, sampler, phase, span, params, cond, schedule, x, loop,
                  guidance_scale, watch=False):  # fmt: skip
        mesh = plan.mesh()
        axes = {plan.strategy.patch_axis(0), plan.strategy.patch_axis(1)}
        rows = plan.patch_rows(x.shape[1], unet) if axes == {"row"} else None
        rows = None if is_even(rows) else rows  # the even split: as it always ran
        whole = x  # uneven: the latent (and the solver's history) padded through the loop
        x = x if is_even(rows) else pad_rows(x, rows)  # (no step pays to pad and join it)
        if loop is None or loop[1] is None:  # the first phase starts the solver history; the
            state = state_template(unet, plan, guidance_scale, mesh, params, whole, cond)
            loop = (sampler.init_carry(x) if loop is None else loop[0], state)  # (and an
            # expert's first) the stale buffers
        fn = _phase_fn(unet, plan, phase, params, cond, guidance_scale, mesh, rows)
        x, carry, state, *first = run_steps(fn, sampler, schedule, x, *loop, *span, watch)
        x = x if is_even(rows) else unpad_rows(x, rows)
        return (x, (carry, state), *first)


STEP = StepProgram()


def placed_params(plan: Plan, unet: Denoiser, params):
    """The parameters as `plan`'s programs take them best, placed once outside them
    (`Program.place`): a pipeline's stages (each device its own blocks); the engine's own
    program places them inside (`parallel.rules`), so the parameters themselves."""
    return plan.program.place(plan, unet, params)


def weight_bytes(plan: Plan, unet: Denoiser, params) -> int:
    """Parameter bytes one device holds under `plan` (a pipeline's stage: its blocks)."""
    return plan.program.weight_bytes(plan, unet, params)


def state_template(unet, plan, guidance_scale, mesh, params, x, cond):
    """Zeros shaped like the stale buffers (global, with the mesh's device axes), from the
    warm-up phase."""
    axis = plan.strategy.patch_axis(0)
    t = jnp.zeros((), jnp.float32)
    state = None
    if plan.cache is not None:  # the buffers first: a cached step reads them (a skip keeps them)
        state = state_template(unet, replace(plan, cache=None), guidance_scale, mesh, params, x,
                               cond)  # fmt: skip
    warm = make_step(unet, plan, "warmup", axis, guidance_scale, mesh)
    with shapes_only():  # a shape trace: its site calls are not the program's
        _, shapes = jax.eval_shape(warm, params, x, t, cond, state)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def abstract_inputs(
    unet: Denoiser,
    latent_hw: tuple[int, int],
    batch: int = 1,
    seq: int | None = None,
    cfg_stack: int | None = None,
):
    """x (B, H, W, C), t and a guidance-stacked Conditioning, all abstract, in the UNet's dtype;
    `seq` text tokens and `cfg_stack` guidance halves, by default the denoiser's own
    (`text_tokens`, `guidance_halves`)."""
    seq = unet.text_tokens if seq is None else seq
    cfg_stack = unet.guidance_halves if cfg_stack is None else cfg_stack
    (x, _, ctx), added = unet.example_inputs(batch, *latent_hw, seq=seq)
    stack = lambda s: jax.ShapeDtypeStruct((cfg_stack, *s.shape), s.dtype)  # noqa: E731
    cond = Conditioning(stack(ctx), {k: stack(v) for k, v in added.items()})
    return x, jax.ShapeDtypeStruct((), jnp.float32), cond


@cache
def stale_sites(unet: Denoiser, plan: Plan, latent_hw: tuple[int, int]) -> int:
    """How many sites send stale activations in the steady phase (what `comm_groups` splits):
    the modules whose warm-up writes a buffer, none under no_sync. Traced abstractly."""
    plan = replace(plan, cache=None)  # the same sites send; the cache only skips some steps
    names = plan.strategy.ops("steady", plan.patch).stale_buffers()
    if not plan.strategy.packs("steady") or not names:
        return 0
    x, t, cond = abstract_inputs(unet, latent_hw, plan.data)
    axis, scale = plan.strategy.patch_axis(0), 5.0 if plan.cfg == 2 else 1.0
    warm = make_step(unet, plan, "warmup", axis, scale, plan.mesh())
    with shapes_only():
        _, state = jax.eval_shape(warm, param_shapes(unet), x, t, cond, None)

    def count(node) -> int:
        here = any(k in names for k in node)
        return here + sum(count(v) for v in node.values() if isinstance(v, dict))

    return count(state)


def _phase_fn(unet, plan, phase, params, cond, guidance_scale, mesh, rows=None):
    """model_fn(x_in, t, i, state) of the run loop for one phase (both patch axes if the
    strategy alternates them); `rows`: uneven patches, x_in padded (`split.pad_rows`)."""
    s = plan.strategy
    steps = {
        a: make_step(unet, plan, phase, a, guidance_scale, mesh, padded=rows)
        for a in ("row", "col")
    }
    row, col = steps["row"], steps["col"]
    if s.patch_axis(0) == s.patch_axis(1):
        one = steps[s.patch_axis(0)]
        return lambda x_in, t, i, st: one(params, x_in, t, cond, st)

    def alternate(x_in, t, i, st):  # naive_patch split=alternate
        return lax.cond(
            i % 2 == 0,
            lambda: row(params, x_in, t, cond, st),
            lambda: col(params, x_in, t, cond, st),
        )

    return alternate


def phase_steps(plan: Plan, steps: int, start: int = 0) -> dict[str, tuple[int, int]]:
    """{phase: (first step, stop)} of the phases of steps [start, steps) that have steps:
    `warmup` (fresh exchanges) then `steady` (stale exchanges, if the strategy has any)."""
    warm = start + plan.strategy.warmup_phase_steps(steps - start)
    spans = {"warmup": (start, warm), "steady": (warm, steps)}
    return {k: v for k, v in spans.items() if v[1] > v[0]}


def expert_phases(plan: Plan, steps: int, experts: Experts | None = None) -> list[tuple]:
    """[(expert, phase, (first step, stop), restart)] in order: each expert's span run as a
    run of its own (`phase_steps` over it), `restart` on the first phase of every expert after
    the first (the stale state dropped, the sampler's history kept: `sampling.experts`).
    Without `experts`: expert None, the phases of `phase_steps`."""
    if experts is None:
        return [(None, p, span, False) for p, span in phase_steps(plan, steps).items()]
    return [
        (k, p, span, k > 0 and j == 0)
        for k, (start, stop) in enumerate(experts.spans(steps))
        for j, (p, span) in enumerate(phase_steps(plan, stop, start).items())
    ]


@partial(jax.jit, static_argnums=(0, 1, 2, 7, 8))
def denoise(
    unet: Denoiser,
    plan: Plan,
    sampler: Sampler,
    params,
    cond,
    schedule: Schedule,
    x,
    guidance_scale: float,
    experts: Experts | None = None,
):
    """All steps of one image batch under `plan`: the warm-up phase, then the steady phase,
    each a single compiled loop (with `experts`, those of each expert in turn: `params` a
    tuple of theirs, each guiding with its own scale). Returns (final latent, final stale
    state)."""
    loop = None
    for k, phase, span, restart in expert_phases(plan, schedule.timesteps.shape[0], experts):
        p, gs = (params, guidance_scale) if k is None else (params[k], experts.scales[k])
        x, loop = plan.program.run_phase(
            unet, plan, sampler, phase, span, p, cond, schedule, x,
            (loop[0], None) if restart else loop, gs,
        )  # fmt: skip
    return x, loop[1]


@partial(
    jax.jit,
    static_argnums=(0, 1, 2, 3, 9),
    static_argnames=("guidance_scale", "watch", "span", "expert", "restart"),
)
def denoise_phase(
    unet: Denoiser,
    plan: Plan,
    sampler: Sampler,
    phase: str,
    params,
    cond,
    schedule: Schedule,
    x,
    loop,
    guidance_scale: float,
    watch: bool = False,
    span: tuple[int, int] | None = None,
    expert: int | None = None,
    restart: bool = False,
):
    """One phase of `denoise` as its own program, so that phases can be timed apart:
    (x, loop) -> (x after the phase, loop), where loop = (solver carry, stale state) and is
    None before the first phase. Chaining the phases of `phase_steps` gives `denoise`; with
    experts, those of `expert_phases`, each given its `span`, `expert` (`params` then the
    experts' tuple) and `restart`. `watch` (a diagnostic replay): also the first step that
    left a NaN or Inf in x."""
    span = phase_steps(plan, schedule.timesteps.shape[0])[phase] if span is None else span
    params = params if expert is None else params[expert]
    loop = (loop[0], None) if restart else loop
    return plan.program.run_phase(
        unet, plan, sampler, phase, span, params, cond, schedule, x, loop, guidance_scale, watch
    )
