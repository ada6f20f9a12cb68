"""dmc.eval.device_activity: a profile's kernels summed once each, regions and host ops left
out, and the device's idle stretches between them."""
from types import SimpleNamespace

import pytest

from dmc.eval.device_activity import device_activity


def test_device_activity_sums_kernels_and_finds_the_idle_stretches():
    """Kernels (annotated spans left out, CPU events ignored) at 0-10, 5-12 (overlapping),
    20-30 and 50-51 us: 28 us of kernels, idle 8 + 20 us, the longer gap first."""
    from torch.autograd import DeviceType

    def event(name, start, end, device=DeviceType.CUDA, annotation=False):
        span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=span)

    prof = SimpleNamespace(events=lambda: [
        event("c", 20.0, 30.0), event("a", 0.0, 10.0), event("host op", 10.0, 90.0,
                                                             device=DeviceType.CPU),
        event("step", 0.0, 60.0, annotation=True), event("b", 5.0, 12.0),
        event("d", 50.0, 51.0)])
    activity = device_activity(prof, gaps=1)
    assert activity["kernel_s"] == pytest.approx(28e-6) and activity["launches"] == 4
    assert activity["idle_s"] == pytest.approx(28e-6)
    assert activity["gaps"] == [{"ms": pytest.approx(0.02), "after": "c", "before": "d"}]
    assert [g["after"] for g in device_activity(prof)["gaps"]] == ["c", "b"]
