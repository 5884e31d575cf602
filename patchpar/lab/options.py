"""The options of a plan as the command line takes them, made from the registries (a new
strategy, step cache, sampler, preset or family brings its options and help with it): the
strategies' options (`StrategyOptions`), the help of the options that name a registry's entry
(`HELP`), the plans built from them (`build_plan`, `build_vae_plan`), and the short flags of
the nested configs' sections (`flat_aliases`)."""

from __future__ import annotations

import typing
from dataclasses import field, fields, make_dataclass
from typing import Annotated, Any

import tyro


def build_plan(
    name: str,
    options: dict,
    devices: int,
    cfg: int,
    comm: bool = True,
    data: int = 1,
    fsdp: bool = False,
    cache: str = "none",
    cache_options: dict | None = None,
    patch_weights: str = "",
    uneven_compute: str = "auto",
):
    """The strategy `name` with the options given (None = the strategy's default), on devices
    split as data x cfg x patch x model, weights sharded per layer with `fsdp`, with the step
    cache `cache` (`patchpar.sampling.cache`; options None = the cache's default), the rows
    split over the patch devices by `patch_weights` ("3,2,2,1"; "": equal shares), each
    device computing its own rows or the largest patch's (`uneven_compute`)."""
    from patchpar.parallel.engine import Plan
    from patchpar.parallel.strategies import make_strategy
    from patchpar.sampling.cache import make_cache

    options = {k: v for k, v in options.items() if v is not None}
    step_cache = make_cache(
        cache, **{k: v for k, v in (cache_options or {}).items() if v is not None}
    )
    measured = patch_weights == "measured"  # timed when the run starts (lab/calibrate.py)
    weights = parse_weights(patch_weights) if patch_weights and not measured else None
    plan = Plan(make_strategy(name, **options), devices, cfg, comm, data, fsdp, step_cache,
                weights, uneven_compute)  # fmt: skip
    if measured:
        check_measured(plan)
    if weights is not None:
        from patchpar.parallel.split import check_weights

        check_weights(weights, plan.patch)
    return plan


def check_measured(plan) -> None:
    """`patch_weights=measured`: every device a patch device of row patches that may be uneven."""
    from patchpar.parallel.checks import uneven_supported

    if plan.patch != plan.devices:
        raise ValueError(
            f"patch_weights=measured: {plan.patch} of the {plan.devices} devices are patch "
            f"devices; measured weights need every device on the patch axis (cfg 1, data 1, "
            f"no tensor parallelism), or give the weights"
        )
    if not plan.splits_row_patches:
        raise ValueError(
            f"patch_weights=measured: strategy {plan.strategy.name!r} on {plan.patch} device(s) "
            f"does not split the rows into row patches; leave patch_weights unset"
        )
    uneven_supported(plan, "rows by measured speed")


def parse_weights(text: str) -> tuple[float, ...]:
    """`3,2,2,1` -> (3.0, 2.0, 2.0, 1.0); a ValueError naming what is not a number."""
    out = []
    for part in text.split(","):
        try:
            out.append(float(part))
        except ValueError:
            raise ValueError(
                f"patch_weights={text!r}: {part.strip()!r} is not a number; give one weight per "
                f"patch device, comma-separated (e.g. 3,2,2,1), or measured"
            ) from None
    return tuple(out)


def build_vae_plan(mode: str, devices: int, data: int, tile: int):
    """The VAE's placement: `mode` (off, rows, tiles) on the run's devices, images over
    `data` (patchpar.parallel.vae.VAEPlan)."""
    from patchpar.parallel.vae import MODES, VAEPlan

    if mode not in MODES:
        raise ValueError(f"vae_parallel={mode!r}; known: {list(MODES)}")
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 0:
        raise ValueError(f"vae_tile={tile!r}: must be 0 (the VAE's sample size) or pixels > 0")
    if tile and mode != "tiles":
        raise ValueError(
            f"vae_tile={tile}: a tile size is for vae_parallel=tiles, and vae_parallel={mode!r} "
            f"decodes without tiles; set vae_parallel=tiles, or leave vae_tile at 0"
        )
    return VAEPlan(mode, devices, data, tile)


def _strategy_options() -> dict[str, tuple[Any, str]]:
    """Every strategy option, from the strategy dataclasses themselves (`patchpar/parallel/
    strategies/`, each option declared with its help by `base.option`): name -> (type, help
    prefixed by the strategies that have it), in registry order. A new strategy brings its options with
    it; nothing here lists them."""
    from patchpar.parallel.strategies import STRATEGIES

    found: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for name, cls in STRATEGIES.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            entry = found.setdefault(f.name, (hints[f.name], {}))
            entry[1].setdefault(f.metadata.get("help", ""), []).append(name)
    # an option that means one thing to some strategies and another to others (warmup_steps:
    # DistriFusion's and PipeFusion's conventions) gets each meaning prefixed by its users
    return {
        k: (t, " ".join(f"{'/'.join(users)}: {text}" for text, users in helps.items()))
        for k, (t, helps) in found.items()
    }


def _registry_help() -> dict[str, str]:
    """Help of the options that name a registry's entry, made from the registries (a new
    strategy, sampler, step cache, preset or model family shows up in --help unedited):
    `model` (the presets that run: trained, or random weights written on first use; or a
    folder), `any_model` (every preset, lowered without weights; or a folder)."""
    from patchpar.models.family import families
    from patchpar.models.presets import PRESETS, SHIPPED, WEIGHTED
    from patchpar.parallel.strategies import STRATEGIES
    from patchpar.sampling.cache import CACHES
    from patchpar.sampling.schedulers import DDPM_SAMPLERS, SAMPLERS

    fams = families().values()
    pipelines = ", ".join(c.removesuffix("Pipeline") for f in fams for c in f.pipeline_classes)
    folder = f"a local diffusers-format folder (pipelines: {pipelines})"
    ddpm = "/".join(f.name for f in fams if f.default_sampler in DDPM_SAMPLERS)
    flow = "/".join(f.name for f in fams if f.default_sampler not in DDPM_SAMPLERS)
    caches = "; ".join(f"{k}: {c.summary.removeprefix('it ')}" for k, c in CACHES.items())
    return {
        "strategy": f"{', '.join(STRATEGIES)} (patchpar/parallel/strategies/).",
        "sampler": f"{', '.join(DDPM_SAMPLERS)} (noise or v prediction: {ddpm} models) or "
        f"{', '.join(s for s in SAMPLERS if s not in DDPM_SAMPLERS)} (flow matching: {flow}).",
        "cache": f"A step cache (reuse across steps, with any one-call strategy): none; {caches}.",
        "model": f"A preset, trained ({', '.join(SHIPPED)}) or with random weights "
        f"({', '.join(WEIGHTED)}), or {folder}.",
        "any_model": f"A preset ({', '.join(sorted([*PRESETS, *SHIPPED]))}) or {folder}.",
    }


HELP = _registry_help()


def _optional(t):
    return t if type(None) in typing.get_args(t) else t | None


_OPTIONS = _strategy_options()
STRATEGY_OPTIONS = tuple(_OPTIONS)


def _options(self) -> dict:
    return {k: getattr(self, k) for k in STRATEGY_OPTIONS if getattr(self, k) is not None}


def _bare_flag(name: str):
    """A boolean strategy option on the command line: `--no-sync` alone is True, `--no-sync
    False` also reads; unset stays None (the strategy's default)."""
    from tyro.constructors import PrimitiveConstructorSpec

    flag = "--" + name.replace("_", "-")

    def parse(args: list[str]) -> bool:
        if not args:
            return True
        if len(args) == 1 and args[0].lower() in ("true", "false"):
            return args[0].lower() == "true"
        raise ValueError(f"{flag} {' '.join(args)!r}: a bare flag ({flag}), or {flag} True/False")

    return PrimitiveConstructorSpec(
        nargs="*",
        metavar="[True|False]",
        instance_from_str=parse,
        is_instance=lambda v: v is None or isinstance(v, bool),
        str_from_instance=lambda v: [str(v)],
    )


def _option_type(name: str, t):
    if t is bool or t == bool | None:
        return Annotated[bool | None, _bare_flag(name)]
    return _optional(t)


StrategyOptions = make_dataclass(
    "StrategyOptions",
    [
        (
            name,
            Annotated[_option_type(name, t), tyro.conf.arg(help=text)],
            field(default=None),
        )
        for name, (t, text) in _OPTIONS.items()
    ],
    frozen=True,
    namespace={"options": _options, "__module__": __name__},
)
StrategyOptions.__doc__ = """The strategies' options (declared in each strategy's own file); one left
    unset (None) keeps the strategy's default, and one the chosen strategy does not have is an
    error."""


def flat_aliases(config_cls) -> dict[str, str]:
    """The short flags of a nested config's sections, generated from their fields: a section's
    `name` is the section's own flag (`--strategy` for `--strategy.name`, `--model`,
    `--sampler`, `--cache`), a cache option is `--cache-<option>`, every other field its own
    name (`--devices` for `--mesh.devices`, `--warmup-steps` for `--strategy.warmup-steps`,
    `--quant` for `--model.quant`); a boolean's `--no-` form too. A short name two sections
    would share, or that a top-level field has, gets no alias."""
    import typing

    hints = typing.get_type_hints(config_cls, include_extras=True)
    top = {f.name for f in fields(config_cls)}
    found: dict[str, list[str]] = {}
    for f in fields(config_cls):
        section = typing.get_args(hints[f.name])[0] if typing.get_origin(
            hints[f.name]) is Annotated else hints[f.name]  # fmt: skip
        if not isinstance(section, type) or not hasattr(section, "__dataclass_fields__"):
            continue
        kinds = typing.get_type_hints(section)
        for g in fields(section):
            short = f.name if g.name == "name" else (
                f"cache_{g.name}" if f.name == "cache" else g.name)  # fmt: skip
            if short in top and short != f.name:
                continue
            flag, leaf = short.replace("_", "-"), g.name.replace("_", "-")
            found.setdefault(f"--{flag}", []).append(f"--{f.name}.{leaf}")
            if kinds[g.name] in (bool, bool | None):  # its negation too
                found.setdefault(f"--no-{flag}", []).append(f"--{f.name}.no-{leaf}")
    return {short: targets[0] for short, targets in found.items() if len(targets) == 1}


def expand_aliases(args: list[str], aliases: dict[str, str]) -> list[str]:
    """A command line with its short flags (`flat_aliases`) written as the nested ones, `--x=v`
    forms too; everything else as it is."""
    out = []
    for arg in args:
        flag, eq, value = arg.partition("=")
        out.append(aliases[flag] + eq + value if flag in aliases else arg)
    return out
