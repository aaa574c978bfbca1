"""The interactive layer: ipywidgets + bqplot views of a report source, and a tuning session."""

from .app import ReportWidget

__all__ = ["ReportWidget"]
