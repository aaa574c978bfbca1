"""Shared set-up for the benchmarks: cases, models prepared three ways, a timer."""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.fx._model_report import detector as upstream_detector
from torch.ao.quantization.fx._model_report.model_report import ModelReport as UpstreamReport

from qreport_widgets import ModelReport, default_detectors
from qreport_widgets.demo.architectures import TinyConvNet, TransformerMlp, resnet18, resnet50
from qreport_widgets.engines.fx.prepare import prepare

THREADS = 2


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], torch.nn.Module]
    shape: tuple[int, ...]


CASES = {
    "tiny-conv 8x3x32x32": Case("tiny-conv 8x3x32x32", lambda: TinyConvNet().eval(), (8, 3, 32, 32)),
    "resnet18 8x3x224x224": Case("resnet18 8x3x224x224", resnet18, (8, 3, 224, 224)),
    "mlp-blocks 8x128x768": Case("mlp-blocks 8x128x768", lambda: TransformerMlp().eval(), (8, 128, 768)),
    "resnet50 8x3x224x224": Case("resnet50 8x3x224x224", resnet50, (8, 3, 224, 224)),
}


def setup() -> None:
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    warnings.simplefilter("ignore")


def batches_for(case: Case, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(*case.shape, generator=generator) for _ in range(count)]


def plain_model(model: torch.nn.Module, example: torch.Tensor) -> torch.fx.GraphModule:
    return prepare(model, get_default_qconfig_mapping("x86"), (example,))


def our_model(model: torch.nn.Module, example: torch.Tensor, exact_percentiles: bool = False) -> torch.fx.GraphModule:
    report = ModelReport(plain_model(model, example), default_detectors("x86"), exact_percentiles=exact_percentiles)
    return report.prepare_detailed_calibration()


def upstream_model(model: torch.nn.Module, example: torch.Tensor) -> torch.fx.GraphModule:
    detectors = {
        upstream_detector.PerChannelDetector("x86"),
        upstream_detector.DynamicStaticDetector(),
        upstream_detector.InputWeightEqualizationDetector(0.5),
        upstream_detector.OutlierDetector(),
    }
    return UpstreamReport(plain_model(model, example), detectors).prepare_detailed_calibration()


def seconds_per_batch(model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    with torch.no_grad():
        start = time.perf_counter()
        for batch in batches:
            model(batch)
        return (time.perf_counter() - start) / len(batches)


def median(values: list[float]) -> float:
    return statistics.median(values)


def model_arguments(description: str, models: list[str]) -> argparse.Namespace:
    """``--models`` (default: ``models``) and ``--cache-dir`` (the trained weights' folder), parsed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--models", nargs="+", default=models)
    parser.add_argument("--cache-dir", default=None)
    return parser.parse_args()


def run_cells(run, float_metric: float) -> str:
    """A real run's markdown cells: its perplexity, its gap to float, its logits' SQNR and its deployed KB."""
    gap = 100 * (run.eval_metric / float_metric - 1)
    return f"{run.eval_metric:.4f} | {gap:+.2f}% | {run.output_sqnr_db:.2f} | {run.deployed_bytes / 1024:.1f}"
