"""Phase spans: who did what, on which device, when — the source of time/* and the Gantt view."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

__all__ = ["PHASES", "PhaseSpan", "PhaseRecorder"]

# The phases DESIGN.md §3.7 reports as time/<phase>; "idle" is what is left of the step.
PHASES = ("rollout", "reward", "reference", "train", "weight_sync", "eval", "checkpoint")


@dataclass
class PhaseSpan:
    device: int
    phase: str
    start: float
    end: float
    step: int

    def to_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


class PhaseRecorder:
    """Records spans of named phases for one device; one recorder per controller or worker."""

    def __init__(self, device: int):
        self.device = device
        self.step = 0
        self._spans: list[PhaseSpan] = []

    @contextmanager
    def span(self, phase: str, *, device: int | None = None) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.add(phase, start, time.time(), device=device)

    def add(self, phase: str, start: float, end: float, *, device: int | None = None) -> None:
        dev = self.device if device is None else device
        self._spans.append(PhaseSpan(dev, phase, start, end, self.step))

    def extend(self, spans: list[dict]) -> None:
        """Adopt spans measured elsewhere (a remote rollout worker), keeping their device."""
        for s in spans:
            self._spans.append(
                PhaseSpan(int(s["device"]), str(s["phase"]), float(s["start"]), float(s["end"]),
                          self.step)
            )

    def take(self) -> list[PhaseSpan]:
        """Return and forget the spans recorded since the last call."""
        spans, self._spans = self._spans, []
        return spans

    @staticmethod
    def durations(spans: list[PhaseSpan], device: int | None = None) -> dict[str, float]:
        """Seconds per phase (summed), optionally for one device only."""
        out: dict[str, float] = {}
        for s in spans:
            if device is None or s.device == device:
                out[s.phase] = out.get(s.phase, 0.0) + (s.end - s.start)
        return out

    @staticmethod
    def busy_fraction(spans: list[PhaseSpan], device: int, start: float, end: float) -> float:
        """Fraction of [start, end] that the device spent inside any span (overlaps merged)."""
        if end <= start:
            return 0.0
        intervals = sorted(
            (max(s.start, start), min(s.end, end))
            for s in spans
            if s.device == device and s.end > start and s.start < end
        )
        busy, cur_s, cur_e = 0.0, None, None
        for a, b in intervals:
            if cur_e is None or a > cur_e:
                if cur_e is not None and cur_s is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = a, b
            else:
                cur_e = max(cur_e, b)
        if cur_e is not None and cur_s is not None:
            busy += cur_e - cur_s
        return min(1.0, busy / (end - start))
