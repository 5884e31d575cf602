"""Typed, frozen configs shared by the commands. Every knob an ablation varies is a field."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlanFlags:
    """Which strategy, on how many devices, with which options (unset options keep the
    strategy's defaults; an option the strategy does not have is an error)."""

    strategy: str = "single"
    """single, naive_patch, sync_patch, distrifusion or pcpp."""
    devices: int = 1
    """Devices in all (= cfg x patch)."""
    cfg: int = 1
    """1: both guidance halves on every device; 2: split across two device halves."""
    warmup_steps: int | None = None
    """distrifusion/pcpp: synchronous steps before going stale are warmup_steps + 1 (default 4; DistriFusion §4.3)."""
    gn: str | None = None
    """distrifusion/pcpp GroupNorm after warm-up: separate, stale, corrected (default), sync (DistriFusion Table 5)."""
    no_sync: bool | None = None
    """distrifusion: exchange nothing after warm-up."""
    portion: float | None = None
    """pcpp: share of each neighbour patch attended to, in (0, 1] (default 0.3, PCPP's code)."""
    send: str | None = None
    """pcpp: full (whole neighbour K/V, as PCPP's code; default) or band (only the rows used)."""
    split: str | None = None
    """naive_patch: row (default), col or alternate."""

    def plan(self):
        """The strategy with the options given, placed on the devices."""
        from patchpar.parallel.engine import Plan
        from patchpar.parallel.strategies import make_strategy

        names = ("warmup_steps", "gn", "no_sync", "portion", "send", "split")
        options = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        return Plan(make_strategy(self.strategy, **options), self.devices, self.cfg)
