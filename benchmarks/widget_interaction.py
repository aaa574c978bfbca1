"""Cost of one interaction in the kernel: time and bytes sent. A module dropdown change to a
4096-channel module; and on a model of 250 modules (50 transformer MLP blocks, 100 Tune rows) the
Explore module dropdown, the Tune filter (typed, then cleared), the "with a suggestion" toggle, and
the Graph tab: first shown (layout and figure), coloured by another number, a folded module opened.

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
from qreport_widgets.observe.graph_layout import NODE_LIMIT

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


def measure_large(repeats: int = 5) -> dict[str, object]:
    """Median kernel time (ms) and largest message total (KB) per interaction on a 250-module model."""
    from qreport_widgets.demo.architectures import TransformerMlp

    comm.create_comm = RecordingComm
    torch.manual_seed(0)
    model = TransformerMlp(hidden=64, blocks=50, ratio=2).eval()
    batches = [(torch.randn(4, 16, 64),) for _ in range(3)]
    report = analyze(model, batches[0], batches[:2], eval_data=batches[2:], progress=False)
    start = time.perf_counter()
    widget = report.widget()
    first_state = time.perf_counter() - start
    tuning, controls = widget.tuning, widget.controls
    modules = [name for name in report.frame().module_names if name.endswith("fc1")][:2]
    actions = {
        "Explore module dropdown": [lambda m=m: setattr(controls.module, "value", m) for m in modules],
        "Tune filter typed / cleared": [
            lambda: setattr(tuning.filter, "value", "fc1"),
            lambda: setattr(tuning.filter, "value", ""),
        ],
        "Tune 'with a suggestion' toggle": [
            lambda: setattr(tuning.only_suggested, "value", True),
            lambda: setattr(tuning.only_suggested, "value", False),
        ],
    }
    found: dict[str, object] = {
        "modules": sum(1 for _ in model.modules()),
        "rows": len(tuning.rows),
        "first_state_s": first_state,
    }
    start = time.perf_counter()
    widget.tabs.selected_index = 2  # the Graph tab, first shown: the layout, the figure, its colours
    found["graph_first_s"] = time.perf_counter() - start
    graph = widget.graph
    found["graph_units"] = len(report.analysis().graph.units)
    found["graph_nodes"] = len(graph.layout_.shown)
    graph.limit = 10_000  # every node drawn, nothing folded: the largest layout
    start = time.perf_counter()
    graph.fold()
    found["graph_unfolded_s"] = time.perf_counter() - start
    found["graph_unfolded_nodes"] = len(graph.layout_.shown)
    graph.limit = NODE_LIMIT
    graph.fold()
    folded = next((n.id for n in graph.layout_.shown if n.kind == "folded"), None)
    options = list(graph.colour_by.options)
    actions["Graph colour by another number"] = [lambda o=o: setattr(graph.colour_by, "value", o) for o in options[:2]]
    if folded is not None:
        actions["Graph click on a folded module / fold again"] = [lambda: graph.pick(folded), graph.fold]
    for name, steps in actions.items():
        times, sizes = [], []
        for _ in range(repeats):
            for step in steps:
                RecordingComm.sent.clear()
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
                sizes.append(sum(RecordingComm.sent))
        found[name] = (median(times) * 1000, max(sizes) / 1024)
    return found


def main() -> None:
    setup()
    row = measure()
    print(
        f"widget: first state {row['first_state_s']:.3f} s; module change to a {row['channels']}-channel module "
        f"{row['change_ms']:.1f} ms in the kernel, {row['sent_kb']:.1f} KB sent (largest of the changes)"
    )
    large = measure_large()
    print(f"{large['modules']} modules, {large['rows']} Tune rows: widget built in {large['first_state_s']:.2f} s")
    print(
        f"  Graph tab first shown ({large['graph_units']} observed modules, {large['graph_nodes']} nodes drawn): "
        f"{large['graph_first_s']:.3f} s; unfolded ({large['graph_unfolded_nodes']} nodes) {large['graph_unfolded_s']:.3f} s"
    )
    for name, value in large.items():
        if isinstance(value, tuple):
            print(f"  {name}: {value[0]:.1f} ms in the kernel (median), {value[1]:.1f} KB sent (largest)")


if __name__ == "__main__":
    main()
