"""Observation: what a calibration saw, as one immutable value.

Owns the observer (the hot path) and exact selection, instrumentation, the detectors, the model's
units and dataflow (``graph``, ``graph_layout``), typed records, the ``Analysis`` and its
``ReportFrame``, torch's visualizer tables, torch's per-module dictionaries (``compat``), and the
merge of observers across torch.distributed ranks.

May import: ``core``, ``errors``. Never the engines, tuning, sharing or the widgets (the
visualizer's plot methods build widget views when called).
"""
