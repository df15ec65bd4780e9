"""Telemetry: phase spans, device utilization, and the reporters that carry them out."""

from trainer.telemetry.devices import DeviceMonitor
from trainer.telemetry.reporters import (
    HttpReporter,
    JsonlReporter,
    MultiReporter,
    Reporter,
    make_reporter,
)
from trainer.telemetry.spans import PHASES, PhaseRecorder, PhaseSpan

__all__ = [
    "DeviceMonitor",
    "HttpReporter",
    "JsonlReporter",
    "MultiReporter",
    "Reporter",
    "make_reporter",
    "PHASES",
    "PhaseRecorder",
    "PhaseSpan",
]
