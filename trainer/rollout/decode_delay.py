"""An injected generation slow-down, for checking that `placement.mode: auto` re-plans when the
workload shifts mid-run (tests, docs/placement.md).

`YATT_SLOW_DECODE="K:SECONDS"` makes every generate call for training step K and later sleep
SECONDS per decode step of its longest response, inside the rollout phase: a slower decoder's
latency floor (a larger model, a contended device) — every device pays it whatever its share,
which favours overlapping generation with training (disaggregated). `"K:SECONDS:token"` sleeps
SECONDS per generated token of the call instead: slower generation *work*, which shrinks with the
share of the batch a device generates (favouring colocate, where every device generates).
Several comma-separated specs make the workload shift more than once; from each spec's step on
it replaces the earlier ones. The demo model's responses end after ~4 tokens whatever
`rollout.max_new_tokens` says, so a length schedule cannot shift its workload; this can. Unset
(the default), it does nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["ENV_VAR", "decode_delay_s", "apply_decode_delay"]

ENV_VAR = "YATT_SLOW_DECODE"


def decode_delay_s(step: int, samples: Sequence[Any], spec: str | None = None) -> float:
    """Seconds to add to a generate call made for training step `step` (0 when not asked)."""
    spec = os.environ.get(ENV_VAR, "") if spec is None else spec
    active: tuple[float, str] | None = None
    for part in filter(None, (p.strip() for p in spec.split(","))):
        fields = part.split(":")
        try:
            from_step, seconds = int(fields[0]), float(fields[1])
            unit = fields[2] if len(fields) == 3 else "step"
            if len(fields) not in (2, 3) or unit not in ("step", "token"):
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(f"{ENV_VAR}={spec!r}: expected 'STEP:SECONDS' or 'STEP:SECONDS:token', "
                             "comma-separated") from None
        if step >= from_step:
            active = (seconds, unit)
    if active is None or not samples:
        return 0.0
    seconds, unit = active
    lengths = [len(s.response_ids) for s in samples]
    return seconds * (sum(lengths) if unit == "token" else max(lengths))


def apply_decode_delay(step: int, samples: Sequence[Any]) -> None:
    """Sleep the injected delay, if any, for a generate call of training step `step`."""
    delay = decode_delay_s(step, samples)
    if delay > 0:
        time.sleep(delay)
