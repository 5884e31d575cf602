"""Compressed and extrapolated exchange of one site's payloads (docs/design.md §2b).

A `Link` sits between a site's payloads ({collective: activation}) and the wire. For every
collective `c` it keeps, in the site's `stale` collection:
- `cx_<kind>_<c>_base`: what this device holds of the payloads it receives (for `gather`,
  every patch's, (n, ...)): the *base* that sender and receiver keep identical;
- `cx_<kind>_<c>_sent`: the base of its own payload (error feedback), or with `residual='plain'`
  its own previous activation;
- `cx_<kind>_<c>_prev`: the base one step earlier (extrapolation);
- `cx_<kind>_<c>_q`: lowrank's warm-start Q (the sender's).

Residual modes (CompactFusion's three curves, arXiv 2507.17511 Fig. 5):
- `ef` (default): send C(x - sent); `base += D(C(x - sent))` on both sides, so sender and
  receiver hold the same base bit for bit (EF21, arXiv 2106.05203);
- `plain`: send C(x - x_prev); receivers accumulate `base += D(...)`, the sender does not
  follow them (their base drifts from the sender's activation);
- `none`: send C(x); the receiver's estimate is D(C(x)).
The bases are updated by *one* decode over this device's own payload and the ones it received,
stacked (`gather`: all of them in patch order), so that device p's base of its own payload and
device q's base of p's payload come from the same operation on the same bytes.

Extrapolation (`extrapolate` = a): the estimate a receiver uses for step t is
`base_{t-1} + a (base_{t-1} - base_{t-2})`, at no extra bytes (a = 0: the last one).
With codec `none` the base is the received activation itself (the residual is not formed).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from patchpar.parallel.codecs import Codec
from patchpar.parallel.mesh import PATCH

RESIDUALS = ("ef", "plain", "none")
EXTRAPOLATE_RANGE = (0.0, 1.0)  # 0: the last step's (today); 1: linear extrapolation


@dataclass(frozen=True)
class Link:
    """How one site kind's payloads are compressed (`codec`, `residual`) and extrapolated.
    `lead`: the payload's leading axes that batch its matrices (see `patchpar.parallel.codecs`)."""

    codec: Codec = Codec()
    residual: str = "ef"
    extrapolate: float = 0.0
    lead: int = 1

    def __post_init__(self):
        if self.residual not in RESIDUALS:
            raise ValueError(f"residual={self.residual!r}; known: {list(RESIDUALS)}")
        lo, hi = EXTRAPOLATE_RANGE
        if not isinstance(self.extrapolate, (int, float)) or not lo <= self.extrapolate <= hi:
            raise ValueError(
                f"extrapolate={self.extrapolate!r} must be in [{lo}, {hi}] (0: last step's "
                f"activation, 1: linear extrapolation from the last two)"
            )

    def wire_bytes(self, shape: tuple[int, ...], itemsize: int) -> int:
        return self.codec.payload_bytes(shape, itemsize, self.lead)

    def _name(self, kind: str, c: str, what: str) -> str:
        return f"cx_{kind}_{c}_{what}"

    def names(self, kind: str, sends: dict) -> list[str]:
        """The stale variables this link keeps for a site's payloads."""
        out = []
        for c in sends:
            out.append(self._name(kind, c, "base"))
            if not self.codec.exact and self.residual != "none":
                out.append(self._name(kind, c, "sent"))
            if self.extrapolate:
                out.append(self._name(kind, c, "prev"))
            if self.codec.name == "lowrank":
                out.append(self._name(kind, c, "q"))
        return out

    # ---------------------------------------------------------------- warm-up: exact

    def start(self, mod, kind: str, sends: dict, got: dict) -> None:
        """After an exact exchange (warm-up): bases = the exact payloads, sent and received."""
        for c, x in sends.items():
            self.codec.check(x.shape, self.lead, f"the {kind} site")
            base = got[c]
            mod.put_variable("stale", self._name(kind, c, "base"), base)
            if not self.codec.exact and self.residual != "none":
                mod.put_variable("stale", self._name(kind, c, "sent"), x)
            if self.extrapolate:
                mod.put_variable("stale", self._name(kind, c, "prev"), base)
            if self.codec.name == "lowrank":
                q0 = self.codec.init_state(x.shape, self.lead)
                mod.put_variable("stale", self._name(kind, c, "q"), q0)

    # ---------------------------------------------------------------- steady: compressed

    def encode(self, mod, kind: str, sends: dict) -> dict:
        """{collective: activation} -> {collective: what goes on the wire} (uint8 payloads;
        the activations themselves for codec `none`). Updates lowrank's and `plain`'s sender
        state."""
        if self.codec.exact:
            return dict(sends)
        wire = {}
        for c, x in sends.items():
            self.codec.check(x.shape, self.lead, f"the {kind} site")
            target = x
            if self.residual != "none":
                sent = mod.variable("stale", self._name(kind, c, "sent"), jnp.zeros_like, x)
                target = x - sent.value
                if self.residual == "plain":
                    sent.value = x  # its own previous activation, for the next residual
            state = None
            if self.codec.name == "lowrank":
                q0 = self.codec.init_state(x.shape, self.lead)
                qv = mod.variable("stale", self._name(kind, c, "q"), lambda q0=q0: q0)
                state = qv.value
            payload, state = self.codec.encode(target, self.lead, state)
            if state is not None:
                qv.value = state
            wire[c] = payload
        return wire

    def held(self, mod, kind: str, sends: dict) -> dict:
        """This link's stale variables of a site, as they are now (zeros if new)."""
        out = {}
        for c, x in sends.items():
            for name in self.names(kind, {c: x}):
                if mod.has_variable("stale", name):
                    out[name] = mod.get_variable("stale", name)
        return out

    def update(self, kind: str, sent_wire: dict, got: dict, held: dict) -> tuple[dict, dict]:
        """After the exchange: (the estimate of each received payload, {variable: new value}).
        `sent_wire`: this device's own wire payloads; `got`: what it received; `held`: its
        link variables before the update."""
        estimates, new = {}, {}
        for c, mine in sent_wire.items():
            base_name = self._name(kind, c, "base")
            base = held[base_name]
            shape = base.shape[1:] if c == "gather" else base.shape
            if self.codec.exact:
                fresh = got[c]
            else:
                fresh = self._decoded(c, mine, got[c], held, kind, shape, base.dtype, new)
            new[base_name] = fresh
            est = fresh
            if self.extrapolate:
                prev_name = self._name(kind, c, "prev")
                est = fresh + self.extrapolate * (fresh - base)
                new[prev_name] = base
            estimates[c] = est
        return estimates, new

    def _decoded(self, c, mine, got, held, kind, shape, dtype, new):
        """The new base of the received payloads (and, in `new`, of the sent one): one decode
        over own and received payloads stacked."""
        base = held[self._name(kind, c, "base")]
        dec = jax.vmap(lambda p: self.codec.decode(p, shape, dtype, self.lead))
        if c == "gather":  # (n, bytes): every patch's, own included
            d = dec(got)
            out = d if self.residual == "none" else base + d
            if self.residual == "ef":
                new[self._name(kind, c, "sent")] = lax.dynamic_index_in_dim(
                    out, lax.axis_index(PATCH), keepdims=False
                )
            return out
        d = dec(jnp.stack([mine, got]))  # (2, ...): own, received
        if self.residual == "none":
            return d[1]
        if self.residual == "ef":
            both = jnp.stack([held[self._name(kind, c, "sent")], base]) + d
            new[self._name(kind, c, "sent")] = both[0]
            return both[1]
        return base + d[1]  # plain: the sender keeps its own activation instead


KINDS = {"kv": 2, "halo": 1}  # site kinds with a codec: the leading axes of their payloads
EXACT_KINDS = {"gn": "GroupNorm statistics stay exact (a few floats per group)"}


def site_codecs(spec: str) -> dict[str, Codec]:
    """A strategy's `codec` option -> {site kind: codec}: one name for K/V (`int2`), or one per
    site kind (`kv=sign1,halo=int8`); ValueError naming what is wrong and what fits."""
    from patchpar.parallel.codecs import parse

    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"codec={spec!r}: give a codec name or kind=codec pairs")
    if "=" not in spec:
        return {"kv": parse(spec.strip())}
    out: dict[str, Codec] = {}
    for part in spec.split(","):
        kind, _, name = (s.strip() for s in part.partition("="))
        if kind in EXACT_KINDS:
            raise ValueError(
                f"codec {part.strip()!r}: {EXACT_KINDS[kind]}; site kinds with codecs: "
                f"{list(KINDS)}"
            )
        if kind not in KINDS:
            raise ValueError(
                f"codec {part.strip()!r}: unknown site kind {kind!r}; site kinds with codecs: "
                f"{list(KINDS)}"
            )
        if kind in out:
            raise ValueError(
                f"codec={spec!r} names site kind {kind!r} twice; give each of {list(KINDS)} "
                f"at most once (e.g. kv=int2,halo=int8)"
            )
        out[kind] = parse(name)
    return out


def site_links(spec: str, residual: str, extrapolate: float) -> dict[str, Link]:
    """{site kind: Link} for the kinds that compress or extrapolate (none: exchanged as today)."""
    codecs = site_codecs(spec)
    links = {}
    for kind, lead in KINDS.items():
        codec = codecs.get(kind, Codec())
        link = Link(codec, residual, extrapolate, lead)  # validates both
        if not codec.exact or extrapolate:
            links[kind] = link
    return links
