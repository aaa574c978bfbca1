"""``python -m qreport_widgets.demo``: the demo's report and suggested mapping, in the terminal."""

from . import main

main()
