"""DeviceSpan: the time between its two marks (host clock on the CPU), 0 when never begun."""
import time

import torch

from dmc.inference.device_span import DeviceSpan


def test_span_on_the_cpu_is_the_time_between_its_marks():
    span = DeviceSpan(torch.device("cpu"))
    assert span.seconds() == 0.0
    span.end()  # an end without a begin marks nothing
    assert span.seconds() == 0.0
    started = time.perf_counter()
    span.begin()
    time.sleep(0.02)
    span.end()
    assert 0.02 <= span.seconds() <= time.perf_counter() - started
