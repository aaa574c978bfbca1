"""What every layer uses and owns nothing of its own: the fixed vocabularies (``features``), the
calibration loop over user data (``calibration``), progress (``progress``), SQNR (``metrics``),
memory (``memory``: copies that share weights, torch's module-keyed caches), the CPU's SIMD levels
(``cpu``) and devices (``devices``: where a model lives, a copy on another, batches moved there).

May import: ``qreport_widgets.errors``. Nothing else of the package.
"""
