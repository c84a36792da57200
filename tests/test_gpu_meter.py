"""GPU busy per node (observability/gpu.py): NVML's figures where a GPU is, none on a CPU node,
and the metric and page built from them."""

from __future__ import annotations

from types import SimpleNamespace

from observability.gpu import GpuMeter
from observability.metrics import EngineMetrics


class FakeNvml:
    """NVML of a node with two GPUs, 35 % and 90 % busy; the second stops reporting later."""

    def __init__(self) -> None:
        self.inits = 0
        self.gpu = [35, 90]

    def nvmlInit(self) -> None:  # noqa: N802 - NVML's names
        self.inits += 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.gpu)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        return i

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:  # noqa: N802
        if self.gpu[h] is None:
            raise RuntimeError("Not Supported")
        return SimpleNamespace(gpu=self.gpu[h], memory=0)


def test_each_gpu_of_the_node_is_read_and_exported():
    nvml = FakeNvml()
    meter = GpuMeter(nvml)  # type: ignore[arg-type]
    assert meter.busy() == {"0": 0.35, "1": 0.9}
    nvml.gpu[1] = None
    assert meter.busy() == {"0": 0.35} and nvml.inits == 1  # opened once
    m = EngineMetrics("m", "r1")
    m.set_gpu_busy("local", {"0": 0.35})
    m.set_gpu_busy("peer", None)  # a CPU peer: nothing
    text = m.render().decode()
    assert 'pgroups_stage_gpu_busy_ratio{gpu="0",model="m",replica="r1",stage="local"} 0.35' in text
    assert 'stage="peer"' not in "".join(line for line in text.splitlines() if "gpu_busy" in line)


def test_a_node_without_nvml_has_no_figure_and_says_why():
    class Broken:
        def nvmlInit(self) -> None:  # noqa: N802
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    meter = GpuMeter(Broken())  # type: ignore[arg-type]
    assert meter.busy() is None and meter.busy() is None
    assert "no NVIDIA GPU" in meter.reason and "libnvidia-ml" in meter.reason


def test_this_node_is_read_through_the_real_library():
    """pynvml imports everywhere; on a CPU node it finds no driver and reports nothing."""
    meter = GpuMeter()
    busy = meter.busy()
    assert busy is None or all(0.0 <= v <= 1.0 for v in busy.values())
    assert (busy is None) == (meter.reason is not None)
