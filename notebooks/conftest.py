"""Notebooks that need an optional extra are skipped, cell by cell, where it is not installed."""

from __future__ import annotations

import importlib.util

import pytest

# notebook -> the extras (module to import, extra to install) it runs
NEEDS = {"11_deploy_to_a_phone.ipynb": (("executorch", "executorch"), ("model_explorer", "explorer"))}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for module, extra in NEEDS.get(item.path.name, ()):
            if importlib.util.find_spec(module) is None:
                item.add_marker(pytest.mark.skip(reason=f"the [{extra}] extra is not installed"))
                break
