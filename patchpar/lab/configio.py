"""Configs to and from YAML and plain dicts: `load_config` and `dump_config`, dotted overrides
(`with_overrides(cfg, {"strategy.portion": 0.5})`), a record's config with the defaults of
fields added since it was written (`point_config`, `with_defaults`), and a nested config from
the command line's short names in Python (`FromFlags.from_flags`)."""

from __future__ import annotations

import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from patchpar.lab.config import (
    CacheConfig,
    MeasureConfig,
    MeshConfig,
    PromptsConfig,
    RunConfig,
    StrategyConfig,
)
from patchpar.lab.options import flat_aliases


def with_defaults(section: type, given: dict) -> dict:
    """A config section as a record holds it, with the defaults of the fields the record
    predates (`with_defaults(MeshConfig, record["config"]["mesh"])`)."""
    return {**to_dict(section()), **given}


def point_config(config: RunConfig | dict) -> dict:
    """A run's config as a point (plain data): without where records go (`results`) or how
    long a worker may take (`timeout_s`), and with the fields older records lack filled in as
    those runs ran (the mesh, strategy, cache, measure and prompts defaults of today; attention `xla`,
    float32 from before kernels and dtypes existed)."""
    d = to_dict(config) if isinstance(config, RunConfig) else dict(config)
    d.pop("results", None)
    d.pop("timeout_s", None)
    d["mesh"] = with_defaults(MeshConfig, d.get("mesh", {}))
    d["strategy"] = with_defaults(StrategyConfig, d.get("strategy", {}))
    d["cache"] = with_defaults(CacheConfig, d.get("cache", {}))
    d["measure"] = with_defaults(MeasureConfig, d.get("measure", {}))
    d["prompts"] = with_defaults(PromptsConfig, d.get("prompts", {}))
    d["model"] = {
        "attention": "xla",
        "block_q": 256,
        "block_kv": 512,
        "quant": "none",
        "scan_blocks": False,
        **d.get("model", {}),
    }
    d["sampler"] = {**d.get("sampler", {})}
    d["sampler"].setdefault("dtype", "float32")
    return d


def to_dict(cfg) -> dict:
    """Plain JSON/YAML types: nested dicts, lists for tuples, str for paths."""

    def plain(v):
        if is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in fields(v)}
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, Path):
            return str(v)
        return v

    return plain(cfg)


def from_dict(cls, data: dict, where: str = ""):
    """Build a (nested) config dataclass from plain data; unknown keys and wrong types are
    errors naming the dotted key and what would fit. Missing keys keep their defaults."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or cls.__name__}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ValueError(f"unknown key {key!r}; known keys here: {sorted(known)}")
    kwargs = {k: _coerce(hints[k], v, f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def _coerce(tp, v, key: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(inner[0], v, key)
        for a in inner:  # e.g. int | str: the first type the value is
            if isinstance(v, a) and not (a is not bool and isinstance(v, bool)):
                return v
        names = " or ".join(a.__name__ for a in inner)
        raise ValueError(f"{key}={v!r}: expected {names}")
    if is_dataclass(tp):
        return from_dict(tp, v, key)
    if origin is tuple:
        if isinstance(v, str | int | float):  # a single value stands for a one-element tuple
            v = [v]
        if not isinstance(v, list | tuple):
            raise ValueError(f"{key}={v!r}: expected a list")
        return tuple(_coerce(args[0], x, key) for x in v)
    if tp is Path:
        if not isinstance(v, str | Path):
            raise ValueError(f"{key}={v!r}: expected a path")
        return Path(v)
    if tp is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if tp in (int, float, str, bool) and (
        not isinstance(v, tp) or (tp is not bool and isinstance(v, bool))
    ):
        hint = ""
        if tp is str and isinstance(v, bool):  # YAML 1.1 reads a bare off/on/yes/no as a bool
            hint = " (in YAML a bare off, on, yes or no is a boolean: quote it, e.g. 'off')"
        raise ValueError(f"{key}={v!r}: expected {tp.__name__}{hint}")
    return v


def with_overrides(cfg, overrides: dict[str, Any]):
    """A new config with dotted keys set: {"strategy.portion": 0.5}. A value for a key naming a
    sub-config (e.g. "strategy") is a mapping that replaces the whole sub-config."""
    data = to_dict(cfg)
    for dotted, value in overrides.items():
        node, parts = data, dotted.split(".")
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node.get(part), dict):
                raise ValueError(
                    f"unknown key {'.'.join(parts[: i + 1])!r} in override {dotted!r}; known: "
                    f"{sorted(k for k, v in node.items() if isinstance(v, dict))}"
                )
            node = node[part]
        if parts[-1] not in node:
            raise ValueError(f"unknown key {dotted!r}; known keys here: {sorted(node)}")
        node[parts[-1]] = value
    return from_dict(type(cfg), data)


def read_yaml(path: str | Path, what: str = "config file"):
    """The data in a YAML file ({} for an empty one); ValueError if it is absent or not YAML."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {str(path)!r} does not exist")
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None


def load_config(path: str | Path, cls=RunConfig):
    """A config from a YAML file (keys not given keep their defaults)."""
    data = read_yaml(path)
    try:
        return from_dict(cls, data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def dump_config(cfg, path: str | Path) -> None:
    import yaml

    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


class FromFlags:
    """`from_flags`, for a nested config (its sections are dataclasses) built in Python the way
    the command line builds it."""

    @classmethod
    def from_flags(cls, **flags):
        """A config from the command line's short names (`strategy="sync_patch", devices=4,
        warmup_steps=1, steps=3`) or its nested ones with `__` for the dot
        (`strategy__warmup_steps=1`), the same map the CLI uses (`options.flat_aliases`); an unknown
        name is a ValueError naming it."""
        aliases, default = flat_aliases(cls), cls()
        dotted = {}
        for key, value in flags.items():
            flag = "--" + key.replace("_", "-")
            if key in {f.name for f in fields(cls)} and not hasattr(
                    getattr(default, key), "__dataclass_fields__"):  # fmt: skip
                dotted[key] = value
            elif flag in aliases:
                dotted[aliases[flag][2:].replace("-", "_")] = value
            elif "__" in key:
                dotted[key.replace("__", ".")] = value
            else:
                raise ValueError(f"{key}={value!r}: not an option of {cls.__name__}")
        return with_overrides(default, dotted)
