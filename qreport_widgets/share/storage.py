"""Save an Analysis to one file and open it again, without pickle.

The file is a zip archive with two members:

- ``report.json``: format and version, what was analyzed, each detector's text report, notes and
  suggestions, the model overview, and for every record the report keys it has; values that are
  not numpy arrays (settings, classifications) are stored here;
- ``arrays.npz``: the numeric columns (one array per detector and key, all records' values
  concatenated) and the activation histograms, read with ``allow_pickle=False``.

A file opened again is an Analysis (:class:`SavedReport`) whose records are ``StoredRecord`` s
with the same columns, so its tables are identical to the original's.

``report.json`` also carries a SHA-256 of its own content and of ``arrays.npz``, so a truncated or
edited file is refused with a clear error instead of loading half a report. Nothing in the file
can run code when it is opened.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import math
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from .._version import __version__
from ..core.features import SuggestionKind
from ..errors import ReportFileError
from ..observe.analysis import Analysis, GraphSummary
from ..observe.records import DetectorResult, StoredRecord, Suggestion

FORMAT = "qreport-widgets report"
VERSION = 2
_JSON, _ARRAYS = "report.json", "arrays.npz"
_NUMERIC_KINDS = "fiub"  # float, signed and unsigned int, bool: stored as arrays


@dataclass(frozen=True, eq=False, repr=False)
class SavedReport(Analysis):
    """An Analysis read from a file: tables, views and the widget's analysis tabs.

    Re-quantizing needs the model and the data, which a file does not hold, so the widget's Tune
    tab says so instead of offering Apply.
    """

    def save(self, path: str | Path) -> Path:
        return save_analysis(self, path)

    def save_html(self, path: str | Path, runs: bool = True) -> Path:
        """This report as one self-contained HTML file that opens offline (a report file holds no
        runs: ``runs`` is accepted for the same call as ``ModelReport.save_html``)."""
        from ..widgets.html_export import write_html

        return write_html(self, path)

    def widget(self) -> Any:
        from ..widgets import ReportWidget

        return ReportWidget(
            self,
            tuning_unavailable=f"This report was opened from {self.source or 'a file'}. Trying other quantization "
            "settings needs the float model and calibration data, which a report file does not hold: run "
            "qreport_widgets.analyze(model, example_inputs, calibration_data) to tune live.",
        )


def save_analysis(analysis: Analysis, path: str | Path) -> Path:
    """Write ``analysis`` to ``path`` atomically; return the path."""
    path = Path(path)
    arrays: dict[str, np.ndarray] = {}
    graph = analysis.graph
    content = {
        "model": analysis.model_name,
        "detectors": list(analysis.detectors),
        "calibration_batches": int(analysis.batches),
        "text_reports": dict(analysis.texts),
        "graph": {
            "units": dict(graph.units),
            "op_counts": dict(graph.ops),
            "layer_type_counts": dict(graph.layer_types),
            "skipped": dict(graph.skipped),
            "kind": graph.kind,
            "joins": {name: list(op_parent) for name, op_parent in graph.joins.items()},
            "edges": [list(edge) for edge in graph.edges],
        },
        "results": [_encode_result(result, f"r{i}", arrays) for i, result in enumerate(analysis.results.values())],
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"qreport_widgets": __version__, "torch": _torch_version(), "numpy": np.__version__},
    }
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    blob = buffer.getvalue()
    document = {"format": FORMAT, "version": VERSION, "sha256": _digest(content, blob), "content": content}
    text = json.dumps(document, indent=1, allow_nan=False).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with zipfile.ZipFile(partial, "w") as archive:
        archive.writestr(_JSON, text, compress_type=zipfile.ZIP_DEFLATED)
        archive.writestr(_ARRAYS, blob, compress_type=zipfile.ZIP_STORED)
    partial.replace(path)  # an interrupted save never leaves a half-written report under the name
    return path


def load_report(path: str | Path) -> SavedReport:
    """Open a file written by ``report.save(path)``; raises ReportFileError if it is not one, or was changed."""
    path = Path(path)
    text, blob = _read_members(path)
    try:
        document = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ReportFileError(f"{path}: {_JSON} is not valid JSON ({error})") from error
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ReportFileError(f"{path} is not a qreport_widgets report file")
    if document.get("version") != VERSION:
        raise ReportFileError(
            f"{path} has report format version {document.get('version')!r}; this qreport_widgets reads version "
            f"{VERSION} (format 1 came from qreport_widgets 0.1: run analyze() again and save the report)"
        )
    content = document.get("content")
    try:
        intact = document.get("sha256") == _digest(content, blob)
    except (TypeError, ValueError, RecursionError):  # content no save would write (NaN tokens, ...)
        intact = False
    if not intact:
        raise ReportFileError(f"{path} was modified after it was saved (checksum mismatch); it cannot be trusted")
    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        _check_fields(content)
        return _decode(content, arrays, path)
    except ReportFileError:
        raise
    except Exception as error:  # a well-formed archive with contents we did not write
        raise ReportFileError(f"{path}: malformed report content ({type(error).__name__}: {error})") from error


def _read_members(path: Path) -> tuple[bytes, bytes]:
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            members = [archive.read(name) for name in (_JSON, _ARRAYS) if name in names]
    except FileNotFoundError:
        raise ReportFileError(f"{path} does not exist") from None
    # ValueError: CRC failures; NotImplementedError: a damaged header naming an unknown compression;
    # RuntimeError: a damaged header flagging a member encrypted
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, zlib.error, NotImplementedError, RuntimeError) as error:
        raise ReportFileError(
            f"{path} is not a readable report file ({type(error).__name__}: {error}); it may be truncated - save it again"
        ) from error
    if len(members) != 2:
        raise ReportFileError(f"{path} is a zip archive but not a saved report (it needs {_JSON} and {_ARRAYS})")
    return members[0], members[1]


# ---------------------------------------------------------------------------------------- writing
def _digest(content: Any, blob: bytes) -> str:
    canonical = json.dumps(content, sort_keys=True, allow_nan=False, separators=(",", ":")).encode()
    return hashlib.sha256(canonical + b"\0" + blob).hexdigest()


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _encode_result(result: DetectorResult, prefix: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """One detector's records, column by column: a key's values over all records share one array."""
    records = result.records
    columns = [dict(record.columns()) for record in records]
    keys = list(dict.fromkeys(key for cols in columns for key in cols))
    encoded_columns = []
    for k, key in enumerate(keys):
        values = [cols[key] for cols in columns if key in cols]
        encoded_columns.append({"key": key, **_encode_values(values, f"{prefix}/{k}", arrays)})
    with_histogram = [
        i for i, r in enumerate(records) if isinstance(getattr(r, "histogram", None), np.ndarray) and r.histogram.size
    ]
    histograms = {"records": with_histogram}
    if with_histogram:
        for part, attribute in (("counts", "histogram"), ("edges", "histogram_edges")):
            parts = [np.asarray(getattr(records[i], attribute)) for i in with_histogram]
            arrays[f"{prefix}/h{part}"] = np.concatenate(parts)
            histograms[f"{part}_lengths"] = [p.size for p in parts]
    return {
        "detector": result.detector,
        "prefix": prefix,
        "modules": [record.module_fqn for record in records],
        "keys": [list(cols) for cols in columns],
        "columns": encoded_columns,
        "histograms": histograms,
        "notes": list(result.notes),
        "suggestions": [
            {
                "module": s.module_fqn,
                "detector": s.detector,
                "kind": s.kind.value,
                "reason": s.reason,
                "evidence": _encode_value(s.evidence),
            }
            for s in result.suggestions
        ],
    }


def _encode_values(values: list[Any], key: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    numpy = [np.asarray(v) for v in values if isinstance(v, (np.ndarray, np.generic))]
    if len(numpy) == len(values) and numpy and len({(a.dtype, a.ndim) for a in numpy}) == 1:
        first = numpy[0]
        if first.dtype.kind in _NUMERIC_KINDS and first.ndim == 1:
            arrays[key] = np.concatenate(numpy)
            return {"array": key, "lengths": [a.size for a in numpy]}
        if first.dtype.kind in _NUMERIC_KINDS and first.ndim == 0:
            arrays[key] = np.stack(numpy)
            return {"array": key, "scalars": True}
    return {"values": [_encode_value(v) for v in values]}


def _encode_value(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, (np.ndarray, np.generic)) and np.ndim(value) == 0:
        value = value.item()
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}  # nan, inf, -inf
    if isinstance(value, str):
        return value
    return {"text": str(value)}  # a custom detector's object: kept as its text


# ---------------------------------------------------------------------------------------- reading
_FIELDS = {
    "model": str,
    "detectors": list,
    "calibration_batches": int,
    "text_reports": dict,
    "graph": dict,
    "results": list,
    "saved_at": str,
    "versions": dict,
}


def _check_fields(content: Any) -> None:
    if not isinstance(content, dict):
        raise ReportFileError("the report content is not a JSON object")
    for name, kind in _FIELDS.items():
        if not isinstance(content.get(name), kind):
            raise ReportFileError(f"field {name!r} is missing or is not a {kind.__name__}")
    texts, graph = content["text_reports"], content["graph"]
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in texts.items()):
        raise ReportFileError("text_reports must map detector names to text")
    for name in ("units", "op_counts", "layer_type_counts", "skipped"):
        if not isinstance(graph.get(name), dict):
            raise ReportFileError(f"graph.{name} is missing")
    pairs = [*graph.get("joins", {}).values(), *graph.get("edges", [])]
    if not isinstance(graph.get("joins", {}), dict) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise ReportFileError("graph.joins and graph.edges must hold pairs")


def _decode(content: Mapping[str, Any], arrays: Mapping[str, np.ndarray], path: Path) -> SavedReport:
    graph = content["graph"]
    results = {}
    for encoded in content["results"]:
        result = _decode_result(encoded, arrays)
        results[result.detector] = result
    if list(results) != list(content["detectors"]):
        raise ReportFileError("the detectors and their results do not agree")
    return SavedReport(
        model_name=content["model"],
        detectors=tuple(map(str, content["detectors"])),
        results=MappingProxyType(results),
        texts=MappingProxyType(dict(content["text_reports"])),
        graph=GraphSummary(
            units=MappingProxyType({str(k): str(v) for k, v in graph["units"].items()}),
            ops=MappingProxyType({str(k): int(v) for k, v in graph["op_counts"].items()}),
            layer_types=MappingProxyType({str(k): int(v) for k, v in graph["layer_type_counts"].items()}),
            skipped=MappingProxyType({str(k): str(v) for k, v in graph["skipped"].items()}),
            kind=str(graph.get("kind", "graph")),  # files written before the eager engine have none
            joins=MappingProxyType({str(k): (str(v[0]), str(v[1])) for k, v in graph.get("joins", {}).items()}),
            edges=tuple((str(a), str(b)) for a, b in graph.get("edges", [])),  # none before the Graph tab
        ),
        batches=content["calibration_batches"],
        saved_at=content["saved_at"],
        source=path,
        versions=MappingProxyType({str(k): str(v) for k, v in content["versions"].items()}),
    )


def _decode_result(encoded: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> DetectorResult:
    modules, keys = [str(m) for m in encoded["modules"]], encoded["keys"]
    if len(keys) != len(modules):
        raise ReportFileError("a detector's records and their keys do not agree")
    values_by_key = {}
    for column in encoded["columns"]:
        holders = sum(column["key"] in record_keys for record_keys in keys)
        values = _decode_values(column, arrays)
        if len(values) != holders:
            raise ReportFileError(f"column {column['key']!r} has {len(values)} values for {holders} records")
        values_by_key[column["key"]] = iter(values)
    columns = [{key: next(values_by_key[key]) for key in record_keys} for record_keys in keys]
    histograms: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    spec = encoded["histograms"]
    if spec["records"]:
        prefix = str(encoded["prefix"])
        counts = _split(arrays[f"{prefix}/hcounts"], spec["counts_lengths"])
        edges = _split(arrays[f"{prefix}/hedges"], spec["edges_lengths"])
        histograms = {int(i): (c, e) for i, c, e in zip(spec["records"], counts, edges, strict=True)}
    records = tuple(
        StoredRecord(module, MappingProxyType(cols), *histograms.get(i, (np.zeros(0), np.zeros(0))))
        for i, (module, cols) in enumerate(zip(modules, columns, strict=True))
    )
    suggestions = tuple(
        Suggestion(
            str(s["module"]), str(s["detector"]), SuggestionKind(s["kind"]), str(s["reason"]), float(_decode_value(s["evidence"]))
        )
        for s in encoded["suggestions"]
    )
    return DetectorResult(str(encoded["detector"]), records, tuple(map(str, encoded["notes"])), suggestions)


def _decode_values(column: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> list[Any]:
    if "values" in column:
        return [_decode_value(v) for v in column["values"]]
    values = arrays[column["array"]]
    if values.dtype.kind not in _NUMERIC_KINDS:
        raise ReportFileError(f"column {column['key']!r}: expected a numeric array, got {values.dtype}")
    if column.get("scalars"):
        return list(values)  # numpy scalars of the saved dtype
    return _split(values, column["lengths"])


def _split(values: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
    if values.ndim != 1 or sum(lengths) != values.size or any(n < 0 for n in lengths):
        raise ReportFileError(f"an array of {values.size} values does not split into lengths summing to {sum(lengths)}")
    return np.split(values, np.cumsum(lengths)[:-1]) if lengths else []


def _decode_value(value: Any) -> Any:
    if isinstance(value, dict):
        if "float" in value:
            return float(value["float"])  # only "nan", "inf", "-inf" are ever written
        return str(value["text"])
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ReportFileError(f"unexpected value {value!r} in a table")
