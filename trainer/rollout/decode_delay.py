"""An injected decode slow-down, for checking that `placement.mode: auto` re-plans when the
workload shifts mid-run (tests, docs/placement.md).

`YATT_SLOW_DECODE="K:SECONDS"` makes every generate call for training step K and later sleep
SECONDS per decode step of its longest response, inside the rollout phase: what a slower decoder
looks like (a larger model's per-token latency floor, a contended device). The demo model's
responses end after ~4 tokens whatever `rollout.max_new_tokens` says, so a length schedule cannot
shift its workload; this can. Unset (the default), it does nothing.
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
    if not spec.strip():
        return 0.0
    try:
        start, per_token = spec.split(":")
        from_step, seconds = int(start), float(per_token)
    except ValueError:
        raise ValueError(f"{ENV_VAR}={spec!r}: expected 'STEP:SECONDS_PER_DECODE_STEP'") from None
    if step < from_step or not samples:
        return 0.0
    return seconds * max(len(s.response_ids) for s in samples)


def apply_decode_delay(step: int, samples: Sequence[Any]) -> None:
    """Sleep the injected delay, if any, for a generate call of training step `step`."""
    delay = decode_delay_s(step, samples)
    if delay > 0:
        time.sleep(delay)
