"""What every layer uses and owns nothing of its own: the fixed vocabularies (``features``), the
calibration loop over user data (``calibration``), progress (``progress``), SQNR (``metrics``) and
memory (``memory``: copies that share weights, torch's module-keyed caches).

May import: ``qreport_widgets.errors``. Nothing else of the package.
"""
