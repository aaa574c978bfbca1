"""Tuning: runs, their history and the diagnoses, behind one facade.

``session.QuantizationSession`` only delegates. The work lives in parts that take values:
``runner`` (prepare -> calibrate -> convert -> measure one configuration, as a frozen ``RunResult``
of ``run``), ``history`` (the runs, which keep their models), ``diagnosis`` (sensitivity, trade-off,
reach), ``verify`` (suggestions measured before they are offered), ``mixed`` (the size front, fit),
``migration`` (outlier-channel scale migration), ``truth`` (the simulation against the real
model) and ``rotations`` (the rotated float model's twin parts: fit weighing rotation, block SQNR).
``parts`` builds them once, in one place; ``questions`` holds the facade's methods answered on the
simulation.

May import: ``engines`` (the contract and the registry, never an engine package), ``observe``,
``core``, ``errors``.
"""
