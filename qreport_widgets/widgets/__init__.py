"""The interactive layer: ipywidgets + bqplot views of a report source and a tuning session.

``ReportWidget`` and its tabs; ``tune_controller.TuneController`` holds the Tune tab's logic
without a widget; ``protocols`` says what the widgets need from the core (``ReportSource``,
``TuningSession``), the only way they see a session. The only package that imports ipywidgets,
bqplot and traitlets.

May import: every layer below (``tune``'s values: runs, verdicts, truth checks; ``observe``'s
frame and layout; ``core``), never an engine package.
"""

from .app import ReportWidget

__all__ = ["ReportWidget"]
