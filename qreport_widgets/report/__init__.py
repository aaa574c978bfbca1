"""torch's ``_model_report`` workflow as a front: ``ModelReport`` (prepare_detailed_calibration,
generate_model_report, generate_qconfig_mapping) over an ``Analysis``, with the tuning session
``analyze()`` attaches.

May import: ``tune``, ``engines`` (the registry), ``observe``, ``core``, ``errors`` (``share`` and
the widgets only inside the methods that save or build them).
"""

from .model_report import ModelReport, ReportState

__all__ = ["ModelReport", "ReportState"]
