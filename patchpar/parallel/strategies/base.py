"""What every strategy answers: its options, validation, phases and per-phase site ops."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from patchpar.models.sites import IDENTITY, SiteOps
from patchpar.parallel.codecs import NAMES as CODECS
from patchpar.parallel.sites.compress import (
    EXTRAPOLATE_RANGE,
    KINDS,
    RESIDUALS,
    site_codecs,
    site_links,
)
from patchpar.parallel.sites.groupnorm import MODES as GROUPNORM_MODES
from patchpar.parallel.sites.text import MODES as TEXT_MODES


def option(default: Any, help: str, quiet: bool = False) -> Any:
    """A strategy option: a dataclass field with its default and its help text (with the paper
    reference); the experiment layer builds its configs and command-line flags from these.
    `quiet`: `describe` leaves it out at its default (an option added after records were keyed
    by `describe`, whose default behaves as before: the old keys stay valid)."""
    return field(default=default, metadata={"help": help, "quiet": quiet})


@dataclass(frozen=True)
class Coded:
    """What a strategy's option codes (or extrapolates) on the wire, to check against the
    sites a model has: `where` (the strategy and the option as given), `keys` {every kind the
    option may name: the site kind that sends it}, `coded` the kinds it codes, `named` those
    of them given one by one (kind=codec pairs; the others come from one codec for all)."""

    where: str
    keys: dict[str, str]
    coded: tuple[str, ...]
    named: tuple[str, ...] = ()

    def check(self, has: frozenset[str], model: str) -> None:
        """ValueError when a kind named has no site in the model, or no kind coded has one
        (`has`: the site kinds the model exchanges; `model`: what it is, `a flux denoiser`)."""
        exchanged = ", ".join(sorted(has)) or "nothing a codec could code"
        fits = [k for k, site in self.keys.items() if site in has]
        fix = f"name only kinds it has: {', '.join(fits)}" if fits else "code nothing (none)"
        for kind in self.named:
            site = self.keys[kind]
            if site not in has:
                sends = "" if site == kind else f" (which sends {kind})"
                raise ValueError(
                    f"{self.where}: {model} has no {site} site{sends} (it exchanges "
                    f"{exchanged}); {fix}"
                )
        sites = sorted({self.keys[k] for k in self.coded})
        if not has & set(sites):
            raise ValueError(
                f"{self.where} codes {', '.join(sites)}, and {model} has no such site (it "
                f"exchanges {exchanged}); {fix}"
            )


@dataclass(frozen=True)
class Strategy:
    """Base: one phase, identity site ops (the single-device reference)."""

    name: ClassVar[str] = "base"
    parallel: ClassVar[bool] = True  # runs under shard_map over the (data, cfg, patch, model) mesh
    rules: ClassVar[str] = "replicated"  # how parameters are placed (`parallel.rules.RULES`)

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def warmup_phase_steps(self, steps: int) -> int:
        """How many of the first steps run in the `warmup` phase (exact exchanges); the rest
        run in the `steady` phase."""
        return steps

    def phase_iterations(self, phase: str, steps: int, patch: int) -> int:
        """Iterations of a phase's compiled loop of `steps` steps on a patch axis of `patch`
        (its body is one step; a pipeline runs one more to drain)."""
        del phase, patch
        return steps

    def program(self):
        """Its own `parallel.program.Program` (PipeFusion: the layers split into stages), or
        None: the engine's (one model call per step with this strategy's site ops)."""
        return None

    def packed_groups(self) -> int | None:
        """Groups of the steady phase's packed stale exchange (`patchpar.parallel.exchange`);
        None: no packed exchange (each site exchanges its own, or nothing is stale)."""
        return None

    def packs(self, phase: str) -> bool:
        """Whether the sites leave their sends for the packed exchange in `phase`."""
        return phase == "steady" and self.packed_groups() is not None

    def model_degree(self, devices: int) -> int:
        """Devices on the model axis (tensor parallel) out of the `devices` an image has (after
        data and cfg); the rest form the patch axis."""
        del devices
        return 1

    def validate_mesh(self, devices: int) -> None:
        """Checks of the strategy's own degrees on the `devices` an image has."""

    def ops(self, phase: str, n: int) -> SiteOps:
        del phase, n
        return IDENTITY

    def patch_axis(self, step_parity: int) -> str:
        """Which latent axis the patches cut: `row` (H) or `col` (W)."""
        del step_parity
        return "row"

    def validate(self, steps: int, patch: int, cfg: int) -> None:
        """Strategy-specific checks beyond the shapes; ValueError naming the numbers."""

    def coded(self) -> Coded | None:
        """What its options code or extrapolate on the wire, checked against the sites of the
        model it runs (`Plan.validate`); None: every exchange goes as it is."""
        return None

    def describe(self) -> str:
        opts = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if not (f.metadata.get("quiet") and getattr(self, f.name) == f.default)
        )
        return f"{self.name}({opts})"


GN_MODES = GROUPNORM_MODES  # the GroupNorm site's modes (parallel/sites/groupnorm.py)
PER_SITE = "per_site"


@dataclass(frozen=True)
class StaleStrategy(Strategy):
    """A warm-up of exact steps, then stale activations (DistriFusion and PCPP share this)."""

    warmup_steps: int = option(
        4,
        "the first warmup_steps + 1 steps run synchronously (default 4; DistriFusion §4.3, "
        "Table 4).",
    )
    gn: str = option(
        "corrected",
        "GroupNorm after warm-up: separate, stale, corrected (default; Eq. 2), sync "
        "(DistriFusion §4.2, Table 5).",
    )
    comm_groups: int | str = option(
        1,
        "the steady phase's stale sends exchanged together in G groups of sites in layer "
        "order, one collective per site kind and dtype per group (distrifuser's "
        "comm_checkpoint; default 1), or per_site (each site its own collectives).",
    )

    codec: str = option(
        "none",
        "compress the steady phase's exchange of activations: one codec for K/V (int2) or one "
        f"per site kind the model has (kv=sign1,halo=int8); codecs {', '.join(CODECS)} "
        "(default none); GroupNorm statistics stay exact (CompactFusion, arXiv 2507.17511).",
        quiet=True,
    )
    residual: str = option(
        "ef",
        "what a codec compresses: ef (the residual against a base sender and receiver keep "
        "identical, error feedback; default), plain (the residual against the last step's "
        "activation), none (the activation itself) (CompactFusion Fig. 5; EF21).",
        quiet=True,
    )
    extrapolate: float = option(
        0.0,
        f"a in [{EXTRAPOLATE_RANGE[0]:g}, {EXTRAPOLATE_RANGE[1]:g}]: a stale site estimates "
        "step t's activation of the other patches as x_{t-1} + a (x_{t-1} - x_{t-2}) from "
        "the last two it received, at no extra bytes (default 0: the last one).",
        quiet=True,
    )

    text: str = option(
        "own",
        "an MMDiT's text stream after warm-up (every device computes it, reading the others' "
        "stale image K/V): own (each device its copy, nothing sent; default), mean (averaged "
        "over the patch axis after every block), first (patch 0's, as xDiT's PipeFusion).",
        quiet=True,
    )

    def links(self) -> dict:
        """{site kind: `sites.compress.Link`} of the kinds that compress or extrapolate."""
        return site_links(self.codec, self.residual, self.extrapolate)

    def coded(self) -> Coded | None:
        links = self.links()
        if not links:
            return None
        named = site_codecs(self.codec) if "=" in self.codec else {}
        given = [f"codec={self.codec!r}"] if self.codec != "none" else []
        given += [f"extrapolate={self.extrapolate!r}"] if self.extrapolate else []
        return Coded(
            f"{self.name}: {', '.join(given)}",
            {k: k for k in KINDS},
            tuple(links),
            tuple(k for k, c in named.items() if not c.exact),
        )

    def __post_init__(self):
        if self.residual not in RESIDUALS:
            raise ValueError(f"{self.name}: residual={self.residual!r}; known: {list(RESIDUALS)}")
        try:  # codec names, ranks, extrapolation
            self.links()
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        if self.gn not in GN_MODES:
            raise ValueError(f"{self.name}: gn={self.gn!r}; known: {list(GN_MODES)}")
        if self.text not in TEXT_MODES:
            raise ValueError(f"{self.name}: text={self.text!r}; known: {list(TEXT_MODES)}")
        g = self.comm_groups
        if g != PER_SITE and (not isinstance(g, int) or isinstance(g, bool) or g < 1):
            raise ValueError(
                f"{self.name}: comm_groups={g!r} must be a positive integer (groups of stale "
                f"sites exchanged together, in layer order) or {PER_SITE!r}"
            )

    def warmup_phase_steps(self, steps: int) -> int:
        return min(steps, self.warmup_steps + 1)

    def packed_groups(self) -> int | None:
        return None if self.comm_groups == PER_SITE else self.comm_groups

    def validate(self, steps: int, patch: int, cfg: int) -> None:
        w = self.warmup_steps
        if not isinstance(w, int) or w < 0:
            raise ValueError(f"{self.name}: warmup_steps={w!r} must be an integer >= 0")
        if w >= steps:
            raise ValueError(
                f"{self.name}: warmup_steps={w} must be < steps={steps} (the first warmup_steps + 1 "
                f"steps run synchronously); use warmup_steps <= {steps - 1}"
            )
