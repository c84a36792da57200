"""How busy each NVIDIA GPU of a node is, from NVML (``nvidia-ml-py``): the seed's "GPU busy"
columns, per stage (the engine replica reads its own node's, the stage actor the peer's).

The figure is NVML's utilisation: the share of its last sample period (1/6 s to 1 s, by
product) in which a kernel ran on the GPU. A node without an NVIDIA driver (a CPU node, this
project's CI) has none: ``GpuMeter.busy()`` is None there, the metric is absent, and the page
says the stage runs on a CPU. NVML is opened once per process; a failure to open it is
remembered (``reason``) and never retried on the scrape path.
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType

log = logging.getLogger(__name__)


class GpuMeter:
    def __init__(self, nvml: ModuleType | None = None) -> None:
        self._nvml = nvml  # pynvml, or a stand-in (tests)
        self._handles: list[object] | None = None
        self.reason: str | None = None  # why there is no figure (no driver, no GPU)
        self._lock = threading.Lock()

    def _open(self) -> list[object]:
        with self._lock:
            if self._handles is not None:
                return self._handles
            self._handles = []
            try:
                nvml = self._nvml
                if nvml is None:
                    import pynvml as nvml  # nvidia-ml-py

                    self._nvml = nvml
                nvml.nvmlInit()
                self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
                if not self._handles:
                    self.reason = "no NVIDIA GPU on this node"
            except Exception as e:  # no driver (a CPU node), no library, a broken install
                self.reason = f"no NVIDIA GPU on this node ({type(e).__name__}: {e})"
                log.info("GPU busy not measured: %s", self.reason)
            return self._handles

    def busy(self) -> dict[str, float] | None:
        """Each GPU's busy share, by its NVML index ("0", "1"...); None on a node without one."""
        handles = self._open()
        if not handles:
            return None
        out: dict[str, float] = {}
        for i, h in enumerate(handles):
            try:
                out[str(i)] = max(0.0, min(1.0, self._nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0))
            except Exception as e:  # a GPU that does not report (some integrated ones): left out
                log.debug("GPU %d reports no utilisation: %s", i, e)
        return out or None


_meter: GpuMeter | None = None


def node_meter() -> GpuMeter:
    """This process's meter of its node's GPUs."""
    global _meter
    if _meter is None:
        _meter = GpuMeter()
    return _meter
