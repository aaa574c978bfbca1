"""The interactive layer: ipywidgets + bqplot views of a ModelReport."""

from .app import ReportWidget

__all__ = ["ReportWidget"]
