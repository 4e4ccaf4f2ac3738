"""One training step under `torch.profiler`, as a markdown table of where its time goes (`train_throughput.py
--profile`): on CUDA the top kernels by device time, the step's device-busy share and its host syncs; on CPU the top
operators by self CPU time.

Host syncs are what issue 36 asks the varlen route to avoid inside layers: calls that make the host wait for the
device (`cudaStreamSynchronize`, `cudaDeviceSynchronize`, `aten::item` / `aten::_local_scalar_dense`, device-to-host
copies). Their count per step, against the layer count, says whether a route syncs once per batch or once per layer.
"""

import time


SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense", "aten::item",
               "Memcpy DtoH")
TOP = 25


def profile_step(step, device: str, path: str, title: str, top: int = TOP) -> None:
    """Run `step()` once under the profiler and append its table, headed by `title`, to `path`."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        start = time.perf_counter()
        step()
        wall_us = (time.perf_counter() - start) * 1e6
    with open(path, "a", encoding="utf-8") as file:
        file.write("\n".join(profile_table(profile.key_averages(), device, wall_us, title, top)) + "\n\n")


def profile_table(events, device: str, wall_us: float, title: str, top: int = TOP) -> list[str]:
    """The markdown section of one profiled step from the profiler's `key_averages()`."""
    cuda = device == "cuda"
    self_time = (lambda event: event.self_device_time_total) if cuda else (lambda event: event.self_cpu_time_total)
    timed = [event for event in events if self_time(event) > 0]
    if cuda:  # kernels only: an operator's self device time is its kernels' again
        timed = [event for event in timed if str(getattr(event, "device_type", "")).endswith("CUDA")] or timed
    timed.sort(key=self_time, reverse=True)
    total = sum(self_time(event) for event in timed)
    syncs = {event.key: event.count for event in events if any(name in event.key for name in SYNC_EVENTS)}
    lines = [f"### {title}\n",
             f"- step wall time {wall_us / 1e3:,.1f} ms; {'device' if cuda else 'CPU'} time in the table's events "
             f"{total / 1e3:,.1f} ms" + (f" (device busy {total / wall_us:.0%} of the step)" if cuda else ""),
             f"- host syncs and device-to-host reads: {', '.join(f'{k} x{v}' for k, v in syncs.items()) or 'none'}",
             "",
             f"| {'kernel' if cuda else 'operator'} | calls | self {'device' if cuda else 'CPU'} ms | share |",
             "|---|---|---|---|"]
    lines += [f"| {event.key[:100].replace('|', '/')} | {event.count} | {self_time(event) / 1e3:,.2f} | "
              f"{self_time(event) / total:.1%} |" for event in timed[:top]]
    return lines
