"""Cost of one dropdown change in the kernel: time and bytes sent, for a 4096-channel module.

Messages are counted by a comm that records what ipywidgets would send to the browser
(JSON state plus binary buffers), so no browser is needed.

    python benchmarks/widget_interaction.py
"""

from __future__ import annotations

import json
import time

import comm
import torch
from comm.base_comm import BaseComm
from common import median, setup
from torch import nn

from qreport_widgets import analyze

WIDE = 4096


class RecordingComm(BaseComm):
    sent: list[int] = []

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):  # noqa: D102
        size = len(json.dumps(data, default=str)) + sum(memoryview(b).nbytes for b in buffers or [])
        RecordingComm.sent.append(size)


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, WIDE)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(WIDE, 64)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def measure(repeats: int = 5) -> dict[str, float]:
    comm.create_comm = RecordingComm
    batches = [(torch.randn(8, 16, 64),) for _ in range(4)]
    report = analyze(Wide().eval(), batches[0], batches, progress=False)
    start = time.perf_counter()
    widget = report.widget()
    first_state = time.perf_counter() - start
    controls = widget.controls
    times, sizes = [], []
    for _ in range(repeats):
        for module in ("fc2", "fc1"):
            RecordingComm.sent.clear()
            start = time.perf_counter()
            controls.module.value = module
            times.append(time.perf_counter() - start)
            sizes.append(sum(RecordingComm.sent))
    channels = int(report.frame().modules.at["fc2", "channels"])
    return {"channels": channels, "first_state_s": first_state, "change_ms": median(times) * 1000, "sent_kb": max(sizes) / 1024}


def main() -> None:
    setup()
    row = measure()
    print(
        f"widget: first state {row['first_state_s']:.3f} s; module change to a {row['channels']}-channel module "
        f"{row['change_ms']:.1f} ms in the kernel, {row['sent_kb']:.1f} KB sent (largest of the changes)"
    )


if __name__ == "__main__":
    main()
