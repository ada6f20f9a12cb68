"""What the device did during a ``torch.profiler`` profile: its kernels' summed time, how many
ran, and where it sat idle between them (the benchmarks' account of a step's device time).

The profiler also gives every host op the device time of the kernels it launched, and a
region's device span (``record_function``) a device event of its own: summing every event's
device time counts an eagerly launched kernel twice and a region's kernels once more. Only the
device's own events, regions left out, are counted here.
"""
from __future__ import annotations


def device_activity(prof, gaps: int = 5) -> dict:
    """``kernel_s``: the summed time of the profile's kernels, copies and fills; ``launches``:
    how many ran; ``idle_s``: the time between the first kernel's start and the last one's end
    with none running; ``gaps``: the ``gaps`` longest of those idle stretches, most first, as
    ``{"ms", "after", "before"}`` (the kernels around it: a host wait, or a host too slow to
    keep the device fed, shows there)."""
    from torch.autograd import DeviceType

    kernels = sorted((e for e in prof.events()
                      if e.device_type == DeviceType.CUDA
                      and not getattr(e, "is_user_annotation", False)),
                     key=lambda e: e.time_range.start)
    idle, stretches, busy_until, previous = 0.0, [], None, None
    for kernel in kernels:
        if busy_until is not None and kernel.time_range.start > busy_until:
            gap = kernel.time_range.start - busy_until
            idle += gap
            stretches.append({"ms": gap / 1e3, "after": previous.name, "before": kernel.name})
        if busy_until is None or kernel.time_range.end > busy_until:
            busy_until, previous = kernel.time_range.end, kernel
    return {"kernel_s": sum(e.time_range.elapsed_us() for e in kernels) / 1e6,
            "launches": len(kernels), "idle_s": idle / 1e6,
            "gaps": sorted(stretches, key=lambda g: -g["ms"])[:gaps]}
