"""Device utilization: psutil for a CPU device (a slice of cores), NVML for a GPU."""

from __future__ import annotations

import os
from typing import Any

import psutil

__all__ = ["DeviceMonitor"]


class DeviceMonitor:
    """Samples utilization and memory of the device this process runs on.

    A CPU device is this process's share of cores: utilization is the process's CPU time over
    the last interval divided by the cores of its slice. A GPU device is read through NVML.
    """

    def __init__(self, index: int, *, device_type: str = "cpu", cores: float = 1.0,
                 gpu_index: int | None = None):
        self.index = index
        self.device_type = device_type
        self.cores = max(cores, 1e-6)
        self._proc = psutil.Process(os.getpid())
        self._proc.cpu_percent(interval=None)  # primes the counter: the first call returns 0
        self._nvml: Any = None
        self._handle: Any = None
        if device_type == "gpu":
            self._open_nvml(self._physical_gpu() if gpu_index is None else gpu_index)

    @staticmethod
    def _physical_gpu() -> int:
        # NVML numbers GPUs physically; Ray pins an actor to one through CUDA_VISIBLE_DEVICES.
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        return int(first) if first.isdigit() else 0

    def _open_nvml(self, gpu_index: int) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
        except Exception:  # no driver: fall back to process-level numbers
            self._nvml = None

    def sample(self) -> dict[str, float]:
        """Return device/<i>/* metrics measured since the previous sample."""
        p = f"device/{self.index}"
        out: dict[str, float] = {}
        if self._nvml is not None:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            out[f"{p}/util_pct"] = float(util.gpu)
            out[f"{p}/memory_mb"] = mem.used / 2**20
            out[f"{p}/memory_total_mb"] = mem.total / 2**20
        else:
            cpu = self._proc.cpu_percent(interval=None)
            out[f"{p}/util_pct"] = min(100.0, cpu / self.cores)
            out[f"{p}/memory_mb"] = self._proc.memory_info().rss / 2**20
            out[f"{p}/memory_total_mb"] = psutil.virtual_memory().total / 2**20
        return out
