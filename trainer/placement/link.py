"""The cost model's link term from a measured weight broadcast (issue 9 item 7).

A disaggregated step moves the policy from the training pool to the rollout pool once, over a
link: ``sync_fixed_s + param bytes / sync_link_Bps`` (trainer/placement/cost_model.py).
`bench/weight_sync.py --two-nodes` measures that broadcast between two Ray nodes — the seconds
from the first byte to the last receiver's end of the round, what a training run reports as
`time/weight_sync` — for policies of different sizes; `calibrate_link` turns those
(bytes, seconds) pairs into the two parameters, and `LinkCalibration.apply` puts them into a
parameter set: the one `fit` made from a cluster's measured steps, or a hardware profile's
(`yatt placement simulate --link FILE`).

The fixed term is shared: the cost model has one ``sync_fixed_s`` for in-place and link movement
(the per-round Ray call and group handshake), so applying a calibration sets it for both.

A running job takes one through `placement.link_calibration`: the driver's online fit and the
`auto` planner fit the cost model with it as the prior of the link terms (`fit(..., link=...)`).
A run has one policy size, so its own `time/weight_sync` cannot tell the round's fixed cost from
the bandwidth; the calibration's bandwidth holds, and the fixed term is fitted to what the run
measures beyond it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.placement.cost_model import CostParams, _nnls

if TYPE_CHECKING:
    from trainer.config import TrainerConfig

__all__ = ["LinkCalibration", "calibrate_link", "config_link_calibration", "load_link_calibration"]


@dataclass(frozen=True)
class LinkCalibration:
    """``seconds = sync_fixed_s + bytes / sync_link_Bps`` for one broadcast over the link."""

    sync_fixed_s: float
    sync_link_Bps: float
    error: float  # mean |predicted - measured| seconds relative to the mean measured seconds
    measurements: list[tuple[float, float]] = field(default_factory=list)  # (bytes, seconds)
    source: dict[str, Any] = field(default_factory=dict)  # where and when it was measured

    def seconds(self, nbytes: float) -> float:
        """The predicted time of one broadcast of `nbytes`."""
        per_byte = nbytes / self.sync_link_Bps if math.isfinite(self.sync_link_Bps) else 0.0
        return self.sync_fixed_s + per_byte

    def apply(self, params: CostParams) -> CostParams:
        """`params` with this link's terms (the fixed term also serves in-place movement)."""
        return replace(params, sync_fixed_s=self.sync_fixed_s, sync_link_Bps=self.sync_link_Bps)

    def to_json(self) -> str:
        data = asdict(self)
        data["sync_link_Bps"] = self.sync_link_Bps if math.isfinite(self.sync_link_Bps) else None
        return json.dumps(data, indent=2)


def calibrate_link(measurements: Sequence[tuple[float, float]], *,
                   source: dict[str, Any] | None = None) -> LinkCalibration:
    """Fit the link term to measured broadcasts, each ``(bytes, seconds)``.

    With two or more different sizes: least squares with non-negative terms on
    ``seconds = fixed + bytes × (1 / bandwidth)``, so the fixed cost of a round and the bandwidth
    come apart; a size-independent time gives an infinite bandwidth (the link costs only its
    fixed time). With one size they cannot come apart: the fixed term is 0 and the whole time is
    bandwidth, which overstates a small policy's sync when the round's fixed cost is not small.
    """
    pts = [(float(b), float(s)) for b, s in measurements]
    if not pts:
        raise ValueError("calibrate_link needs at least one measured broadcast")
    if any(b <= 0 or s <= 0 or not math.isfinite(b) or not math.isfinite(s) for b, s in pts):
        raise ValueError(f"every broadcast needs positive bytes and seconds, got {pts}")
    if len({b for b, _ in pts}) >= 2:
        fixed, per_byte = _nnls([[1.0, b] for b, _ in pts], [s for _, s in pts])
    else:
        fixed, per_byte = 0.0, sum(s for _, s in pts) / sum(b for b, _ in pts)
    bandwidth = 1.0 / per_byte if per_byte > 0 else math.inf
    cal = LinkCalibration(fixed, bandwidth, 0.0, pts, dict(source or {}))
    err = sum(abs(cal.seconds(b) - s) for b, s in pts) / sum(s for _, s in pts)
    return replace(cal, error=err)


def load_link_calibration(path: str | Path) -> LinkCalibration:
    """A calibration written by `LinkCalibration.to_json` (bench/weight_sync.py --two-nodes)."""
    data = json.loads(Path(path).read_text())
    bw = data.get("sync_link_Bps")
    return LinkCalibration(sync_fixed_s=float(data["sync_fixed_s"]),
                           sync_link_Bps=math.inf if bw is None else float(bw),
                           error=float(data.get("error", 0.0)),
                           measurements=[(float(b), float(s)) for b, s in data.get("measurements", [])],
                           source=dict(data.get("source", {})))


def config_link_calibration(cfg: TrainerConfig) -> LinkCalibration | None:
    """The calibration `cfg.placement.link_calibration` names, or None when it names none.

    Read where the run starts (`yatt train` before Ray, the driver on the cluster), not when a
    config is parsed: every actor re-parses its config, and a second node need not have the file.
    A file that is missing or is not a calibration is a ConfigError naming the field."""
    from trainer.config import ConfigError

    path = cfg.placement.link_calibration
    if path is None:
        return None
    field_name = "placement.link_calibration"
    try:
        cal = load_link_calibration(path)
    except OSError as exc:
        raise ConfigError([(field_name, f"cannot read {path}: {exc.strerror or exc}")]) from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ConfigError([(field_name, f"{path} is not a link calibration (bench/weight_sync.py "
                            f"--two-nodes writes one): {what}")]) from None
    if not (cal.sync_fixed_s >= 0 and math.isfinite(cal.sync_fixed_s) and cal.sync_link_Bps > 0):
        raise ConfigError([(field_name, f"{path}: sync_fixed_s must be ≥ 0 and sync_link_Bps > 0, "
                            f"got {cal.sync_fixed_s} and {cal.sync_link_Bps}")])
    return cal
