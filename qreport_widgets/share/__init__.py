"""What leaves the process: report files (JSON + numpy arrays, no pickle) and ``SavedReport``.

May import: ``observe``, ``core``, ``errors``, ``_version`` (the widgets only inside the methods
that build them: ``SavedReport.widget()``, ``save_html()``).
"""
