"""report.save(path) / load_report(path): exact round trip, no pickle, clear errors on damaged files."""

from __future__ import annotations

import io
import json
import os
import zipfile

import numpy as np
import pandas as pd
import pytest
from conftest import prepared
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import ConvNet, conv_batches

import qreport_widgets as qw
from qreport_widgets import demo
from qreport_widgets.core import features as F
from qreport_widgets.share.storage import _digest


@pytest.fixture(scope="module")
def report():
    batches = demo.demo_batches(4)
    return qw.analyze(demo.build_demo_model(), batches[0], batches, qconfig_mapping=demo.demo_qconfig_mapping(), progress=False)


@pytest.fixture
def saved(report, tmp_path):
    return report.save(tmp_path / "demo.qreport")


def assert_same_report(loaded, report) -> None:
    a, b = report.frame(), loaded.frame()
    for table in ("modules", "channels", "suggestions"):
        pd.testing.assert_frame_equal(getattr(a, table), getattr(b, table), check_exact=True, check_index_type=True)
    assert a.present == b.present and list(a.histograms) == list(b.histograms)
    for module, (counts, edges) in a.histograms.items():
        np.testing.assert_array_equal(b.histograms[module][0], counts)
        np.testing.assert_array_equal(b.histograms[module][1], edges)
    assert loaded.text_reports() == report.text_reports()
    mine, theirs = loaded.suggestions(), report.suggestions()
    assert [(s.module_fqn, s.detector, s.kind, s.reason) for s in mine] == [
        (s.module_fqn, s.detector, s.kind, s.reason) for s in theirs
    ]
    np.testing.assert_array_equal([s.evidence for s in mine], [s.evidence for s in theirs])  # NaN where none
    assert loaded.calibration_batches() == report.calibration_batches()
    assert loaded.graph.skipped == report.graph.skipped and loaded.graph.op_counts() == report.graph.op_counts()


def test_round_trip_is_exact(report, saved):
    loaded = qw.load_report(saved)
    assert_same_report(loaded, report)
    assert loaded.model_name == "DemoNet" and list(loaded.detectors) == [d.get_detector_name() for d in report.detectors]
    assert loaded.versions["qreport_widgets"] == qw.__version__
    pd.testing.assert_frame_equal(loaded.to_dataframe(), report.to_dataframe(), check_exact=True)
    again = qw.load_report(loaded.save(saved.with_name("again.qreport")))
    assert_same_report(again, report)


def test_the_file_is_json_and_arrays_only(saved):
    with zipfile.ZipFile(saved) as archive:
        assert sorted(archive.namelist()) == ["arrays.npz", "report.json"]
        document = json.loads(archive.read("report.json"))  # strict JSON: no NaN tokens
        with np.load(io.BytesIO(archive.read("arrays.npz")), allow_pickle=False) as arrays:
            assert all(arrays[name].dtype != object for name in arrays.files)
    assert document["format"] == "qreport-widgets report" and document["version"] == 2


def test_visualizer_and_widget_from_a_loaded_report(report, saved):
    loaded = qw.load_report(saved)
    tables = loaded.generate_visualizer().generate_table_visualization(module_fqn_filter="mlp")
    expected = report.generate_visualizer().generate_table_visualization(module_fqn_filter="mlp")
    pd.testing.assert_frame_equal(tables.channel_level, expected.channel_level)
    widget = loaded.widget()
    assert "DemoNet (saved" in widget.header.value and "17 suggestions" in widget.header.value
    widget.controls.module.value = "mlp.fc1"
    widget.controls.feature.value = F.OUTLIER_RATIOS
    np.testing.assert_array_equal(
        widget.views.line.drawn()[1], report.frame().channel_values("mlp.fc1", F.OUTLIER_RATIOS).astype("f4")
    )
    widget.controls.view.value = "Histogram"
    assert widget.views.histogram.bars.y.sum() == 32
    assert "analyze(" in widget.tuning.status.value and widget.tuning.apply.disabled
    assert "call_module" in widget.tabs.children[3].value
    assert len(widget.tabs.children[4].children) == 4


def test_report_without_analyze_round_trips(tmp_path):
    report = qw.ModelReport(prepared(ConvNet(), conv_batches()[0]), [qw.OutlierDetector(), qw.DynamicStaticDetector()])
    with pytest.raises(qw.ReportNotGeneratedError):
        report.save(tmp_path / "early.qreport")
    model = report.prepare_detailed_calibration()
    with pytest.raises(qw.NotCalibratedError):
        report.save(tmp_path / "early.qreport")
    for batch in conv_batches():
        model(*batch)
    report.generate_model_report()
    assert_same_report(qw.load_report(report.save(tmp_path / "late.qreport")), report)


def rewrite(path, *, document=None, arrays=None, recompute=False):
    """The file with its JSON document or array member replaced (and the checksum recomputed, as
    someone crafting a file would)."""
    with zipfile.ZipFile(path) as archive:
        text, blob = archive.read("report.json"), archive.read("arrays.npz")
    document = document(json.loads(text)) if document else json.loads(text)
    blob = arrays if arrays is not None else blob
    if recompute:
        document["sha256"] = _digest(document["content"], blob)
    out = path.with_name("tampered.qreport")
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("report.json", json.dumps(document))
        archive.writestr("arrays.npz", blob)
    return out


def edit(field, value):
    def change(document):
        document["content"][field] = value
        return document

    return change


class Boom:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path(__import__('os').environ['QREPORT_MARKER']).write_text('ran')",))


def test_damaged_and_tampered_files_are_refused(saved, tmp_path, monkeypatch):
    with pytest.raises(qw.ReportFileError, match="does not exist"):
        qw.load_report(tmp_path / "missing.qreport")
    data = saved.read_bytes()
    (tmp_path / "cut.qreport").write_bytes(data[: len(data) // 2])
    with pytest.raises(qw.ReportFileError, match="truncated"):
        qw.load_report(tmp_path / "cut.qreport")
    (tmp_path / "notes.txt").write_text("not a report")
    with pytest.raises(qw.ReportFileError, match="not a readable report"):
        qw.load_report(tmp_path / "notes.txt")
    with pytest.raises(qw.ReportFileError, match="modified after it was saved"):
        qw.load_report(rewrite(saved, document=edit("model", "Other")))
    with pytest.raises(qw.ReportFileError, match="version 99"):
        qw.load_report(rewrite(saved, document=lambda d: {**d, "version": 99}))
    with pytest.raises(qw.ReportFileError, match="format 1 came from qreport_widgets 0.1: run analyze"):
        qw.load_report(rewrite(saved, document=lambda d: {**d, "version": 1}))
    with pytest.raises(qw.ReportFileError, match="'calibration_batches' is missing or is not a int"):
        qw.load_report(rewrite(saved, document=edit("calibration_batches", "many"), recompute=True))
    # a crafted file whose arrays hold a pickle: refused, and the pickle never runs
    marker = tmp_path / "marker"
    monkeypatch.setenv("QREPORT_MARKER", str(marker))
    buffer = io.BytesIO()
    np.savez(buffer, **{"modules/0": np.array([Boom()], dtype=object)})
    with pytest.raises(qw.ReportFileError, match="malformed report content.*allow_pickle"):
        qw.load_report(rewrite(saved, arrays=buffer.getvalue(), recompute=True))
    assert not marker.exists()


def test_save_is_atomic(report, saved, monkeypatch):
    before = saved.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez_compressed", fail)
    with pytest.raises(OSError, match="disk full"):
        report.save(saved)
    assert saved.read_bytes() == before  # the earlier file under that name is intact


def test_odd_documents_are_refused_not_crashed_on(saved, tmp_path):
    with pytest.raises(qw.ReportFileError, match="checksum mismatch"):  # a NaN token no save writes
        qw.load_report(rewrite(saved, document=edit("calibration_batches", float("nan"))))
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as archive:
        archive.writestr("data.csv", "a,b\n1,2\n")
    with pytest.raises(qw.ReportFileError, match="not a saved report"):
        qw.load_report(other)
    with zipfile.ZipFile(other, "w") as archive:
        archive.writestr("report.json", "[" * 100_000)
        archive.writestr("arrays.npz", b"")
    with pytest.raises(qw.ReportFileError, match="not valid JSON"):
        qw.load_report(other)


@pytest.mark.parametrize(
    ("offset", "value", "raised"),
    [(10, 99, "NotImplementedError"), (8, 1, "RuntimeError")],
    ids=["unknown compression", "encrypted flag"],
)
def test_a_damaged_central_directory_entry_is_a_report_file_error(saved, tmp_path, offset, value, raised):
    """One byte of report.json's central directory entry changed: its compression method (offset 10)
    made one zipfile cannot read, or its flags (offset 8) marking it encrypted; zipfile raises
    NotImplementedError / RuntimeError there, not BadZipFile."""
    damaged = bytearray(saved.read_bytes())
    entry = damaged.rindex(b"report.json") - 46  # its central directory entry: the name's last mention, 46 bytes in
    assert damaged[entry : entry + 4] == b"PK\x01\x02"
    damaged[entry + offset] = value
    path = tmp_path / "damaged.qreport"
    path.write_bytes(bytes(damaged))
    with pytest.raises(qw.ReportFileError, match=f"not a readable report file \\({raised}"):
        qw.load_report(path)


@pytest.fixture(scope="module")
def pristine(report, tmp_path_factory):
    return report.save(tmp_path_factory.mktemp("fuzz") / "demo.qreport")  # saved once: compression varies


@settings(
    max_examples=int(os.environ.get("QREPORT_FUZZ_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_any_corruption_is_a_report_file_error_or_harmless(report, pristine, tmp_path_factory, data):
    damaged = bytearray(pristine.read_bytes())
    for _ in range(data.draw(st.integers(1, 8))):
        position = data.draw(st.integers(0, len(damaged) - 1))
        damaged[position] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        damaged = damaged[: data.draw(st.integers(0, len(damaged)))]
    path = tmp_path_factory.mktemp("fuzz") / "damaged.qreport"
    path.write_bytes(bytes(damaged))
    try:
        loaded = qw.load_report(path)
    except qw.ReportFileError:
        return
    assert_same_report(loaded, report)  # only bytes the zip does not read (padding, comments) changed
