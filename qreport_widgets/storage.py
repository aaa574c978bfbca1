"""Save a generated report to one file and open it again, without pickle.

The file is a zip archive with two members:

- ``report.json``: format and version, what was analyzed, each detector's text report, the model
  overview, and every table column that is not a plain numeric array (strings, nullable booleans);
- ``arrays.npz``: the numeric columns and the activation histograms, read with
  ``allow_pickle=False``.

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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from .errors import ReportFileError
from .features import SuggestionKind
from .frame import ReportFrame

if TYPE_CHECKING:
    from .detectors.base import Suggestion
    from .report import ModelReport
    from .visualizer import ModelReportVisualizer

FORMAT = "qreport-widgets report"
VERSION = 1
_JSON, _ARRAYS = "report.json", "arrays.npz"
_NUMERIC_KINDS = "fiub"  # float, signed and unsigned int, bool: stored as arrays
_VALUE_DTYPES = {"object", "boolean", "str", "string"}  # stored as JSON values


class SavedReport:
    """A report opened from a file: tables, views and the widget's analysis tabs.

    Re-quantizing needs the model and the data, which a file does not hold, so the widget's Tune
    tab explains that instead of offering Apply.
    """

    def __init__(self, content: Mapping[str, Any], frame: ReportFrame, source: Path | None = None) -> None:
        self._content = dict(content)
        self._frame = frame
        self.source = source
        self.analysis_inputs = None
        self.session = None

    @property
    def model_name(self) -> str:
        return str(self._content["model"])

    @property
    def detectors(self) -> list[str]:
        """The detectors' names (the objects themselves are not saved)."""
        return list(self._content["detectors"])

    @property
    def saved_at(self) -> str:
        return str(self._content["saved_at"])

    @property
    def versions(self) -> dict[str, str]:
        """Package versions the report was made with."""
        return dict(self._content["versions"])

    @property
    def graph(self) -> GraphSummary:
        return GraphSummary(self._content["graph"])

    def calibration_batches(self) -> int:
        return int(self._content["calibration_batches"])

    def frame(self) -> ReportFrame:
        return self._frame

    def to_dataframe(self) -> pd.DataFrame:
        return self._frame.to_dataframe()

    def text_reports(self) -> dict[str, str]:
        return dict(self._content["text_reports"])

    def suggestions(self) -> list[Suggestion]:
        from .detectors.base import Suggestion

        return [
            Suggestion(row.module, row.detector, SuggestionKind(row.kind), row.reason, float(row.evidence))
            for row in self._frame.suggestions.itertuples(index=False)
        ]

    def generate_visualizer(self) -> ModelReportVisualizer:
        from .visualizer import ModelReportVisualizer

        return ModelReportVisualizer(self._frame)

    def widget(self) -> Any:
        from .widgets import ReportWidget

        return ReportWidget(self)

    def save(self, path: str | Path) -> Path:
        return _write(path, self._content, self._frame)

    def __repr__(self) -> str:
        where = f" from {self.source}" if self.source else ""
        return f"<SavedReport of {self.model_name}{where}: {len(self._frame.module_names)} modules>"


class GraphSummary:
    """What the widget's Model tab shows of a graph that is no longer at hand."""

    def __init__(self, content: Mapping[str, Any]) -> None:
        self.skipped: dict[str, str] = dict(content["skipped"])
        self._ops = dict(content["op_counts"])
        self._layers = dict(content["layer_type_counts"])

    def op_counts(self) -> dict[str, int]:
        return dict(self._ops)

    def layer_type_counts(self) -> dict[str, int]:
        return dict(self._layers)


def save_report(report: ModelReport, path: str | Path) -> Path:
    """Write a generated ModelReport to ``path``; return the path (``SavedReport.save`` re-saves)."""
    frame = report.frame()  # raises ReportNotGeneratedError with the next step when there is none
    graph = report.graph
    content = {
        "model": report.model_name,
        "detectors": [d.get_detector_name() for d in report.detectors],
        "calibration_batches": report.calibration_batches(),
        "text_reports": report.text_reports(),
        "graph": {"op_counts": graph.op_counts(), "layer_type_counts": graph.layer_type_counts(), "skipped": graph.skipped},
    }
    return _write(path, content, frame)


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
            f"{path} has report format version {document.get('version')!r}; this qreport_widgets reads version {VERSION}"
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
        return SavedReport(content, _decode_frame(content["tables"], arrays), path)
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
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, zlib.error) as error:  # ValueError: CRC failures
        raise ReportFileError(
            f"{path} is not a readable report file ({type(error).__name__}: {error}); it may be truncated - save it again"
        ) from error
    if len(members) != 2:
        raise ReportFileError(f"{path} is a zip archive but not a saved report (it needs {_JSON} and {_ARRAYS})")
    return members[0], members[1]


# ---------------------------------------------------------------------------------------- writing
def _write(path: str | Path, content: Mapping[str, Any], frame: ReportFrame) -> Path:
    from . import __version__

    path = Path(path)
    arrays: dict[str, np.ndarray] = {}
    content = {
        **{k: v for k, v in content.items() if k not in ("tables", "saved_at", "versions")},
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"qreport_widgets": __version__, "torch": _torch_version(), "pandas": pd.__version__},
        "tables": _encode_frame(frame, arrays),
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


def _digest(content: Any, blob: bytes) -> str:
    canonical = json.dumps(content, sort_keys=True, allow_nan=False, separators=(",", ":")).encode()
    return hashlib.sha256(canonical + b"\0" + blob).hexdigest()


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _encode_frame(frame: ReportFrame, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    tables = {
        name: _encode_table(table, name, arrays)
        for name, table in (("modules", frame.modules), ("channels", frame.channels), ("suggestions", frame.suggestions))
    }
    histograms = []
    for i, (module, (counts, edges)) in enumerate(frame.histograms.items()):
        arrays[f"histogram/{i}/counts"], arrays[f"histogram/{i}/edges"] = np.asarray(counts), np.asarray(edges)
        histograms.append(module)
    tables["histograms"] = histograms
    tables["present"] = {module: sorted(features) for module, features in frame.present.items()}
    return tables


def _encode_table(table: pd.DataFrame, name: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    columns = [_encode_column(table[column], column, f"{name}/{i}", arrays) for i, column in enumerate(table.columns)]
    index = table.index
    if isinstance(index, pd.RangeIndex):
        return {"columns": columns, "index": {"name": index.name, "range": [index.start, index.stop, index.step]}}
    return {"columns": columns, "index": _encode_column(pd.Series(index), index.name, f"{name}/index", arrays)}


def _encode_column(column: pd.Series, name: Any, key: str, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    dtype = column.dtype
    if isinstance(dtype, np.dtype) and dtype.kind in _NUMERIC_KINDS:
        arrays[key] = column.to_numpy()
        return {"name": name, "array": key}
    kind = str(dtype)  # "object", "boolean", "str" (NaN-missing strings) or "string" (NA-missing)
    if kind not in _VALUE_DTYPES:
        raise TypeError(f"column {name!r} has dtype {dtype}, which a report file cannot hold")
    return {"name": name, "dtype": kind, "values": [_encode_value(v) for v in column.tolist()]}


def _encode_value(value: Any) -> Any:
    if value is None or value is pd.NA:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else {"float": repr(value)}  # nan, inf, -inf
    if isinstance(value, str):
        return value
    return {"text": str(value)}  # a custom detector's object: kept as its text


# ---------------------------------------------------------------------------------------- reading
_FIELDS = {"model": str, "detectors": list, "calibration_batches": int, "text_reports": dict, "graph": dict, "tables": dict}


def _check_fields(content: Any) -> None:
    if not isinstance(content, dict):
        raise ReportFileError("the report content is not a JSON object")
    for name, kind in _FIELDS.items():
        if not isinstance(content.get(name), kind):
            raise ReportFileError(f"field {name!r} is missing or is not a {kind.__name__}")
    texts, graph = content["text_reports"], content["graph"]
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in texts.items()):
        raise ReportFileError("text_reports must map detector names to text")
    for name in ("op_counts", "layer_type_counts", "skipped"):
        if not isinstance(graph.get(name), dict):
            raise ReportFileError(f"graph.{name} is missing")


def _decode_frame(tables: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> ReportFrame:
    modules, channels, suggestions = (_decode_table(tables[name], arrays) for name in ("modules", "channels", "suggestions"))
    histograms = {
        module: (arrays[f"histogram/{i}/counts"], arrays[f"histogram/{i}/edges"]) for i, module in enumerate(tables["histograms"])
    }
    present = {str(module): frozenset(map(str, features)) for module, features in tables["present"].items()}
    if int(modules["channels"].sum()) != len(channels) or list(modules.index) != list(present):
        raise ReportFileError("the module and channel tables do not agree")
    return ReportFrame(modules, channels, suggestions, histograms, present)


def _decode_table(encoded: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> pd.DataFrame:
    if "range" in encoded["index"]:
        start, stop, step = (int(v) for v in encoded["index"]["range"])
        index = pd.RangeIndex(start, stop, step, name=encoded["index"]["name"])
    else:
        index = pd.Index(_decode_column(encoded["index"], arrays), name=encoded["index"]["name"])
    columns = [_decode_column(column, arrays) for column in encoded["columns"]]
    for column in columns:
        if len(column) != len(index):
            raise ReportFileError(f"column {column.name!r} has {len(column)} rows, the table {len(index)}")
    return pd.DataFrame({column.name: column.set_axis(index) for column in columns}, index=index)


def _decode_column(encoded: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> pd.Series:
    name = encoded["name"]
    if "array" in encoded:
        values = arrays[encoded["array"]]
        if values.ndim != 1 or values.dtype.kind not in _NUMERIC_KINDS:
            raise ReportFileError(f"column {name!r}: expected a 1-D numeric array, got {values.dtype} {values.shape}")
        return pd.Series(values, name=name)
    dtype = encoded["dtype"]
    if dtype not in _VALUE_DTYPES:
        raise ReportFileError(f"column {name!r}: unknown column type {dtype!r}")
    values = [_decode_value(v) for v in encoded["values"]]
    return pd.Series(values, name=name, dtype=dtype)


def _decode_value(value: Any) -> Any:
    if isinstance(value, dict):
        if "float" in value:
            return float(value["float"])  # only "nan", "inf", "-inf" are ever written
        return str(value["text"])
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ReportFileError(f"unexpected value {value!r} in a table")
