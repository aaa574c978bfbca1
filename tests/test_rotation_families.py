"""The README's table of which rotations each decoder family takes, checked row by row on tiny models
transformers builds from each family's config: what ``rotation_problems`` says, and ``rotate`` with
its own check of the rotated model's logits against the original's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hf_models import FAMILIES, VOCAB, tiny_family

import qreport_widgets as qw

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_rows() -> dict[str, tuple[bool, bool]]:
    """family -> (R1 + R2 applies, R2 alone applies), from the README's table."""
    text = README.read_text()
    table = re.search(r"<!-- rotation families -->\n(.*?)<!-- end rotation families -->", text, re.S)
    assert table, "README.md has no rotation families table"
    rows = {}
    for line in table.group(1).strip().splitlines()[2:]:
        families, both, values, _ = (cell.strip() for cell in line.strip("|").split("|"))
        for family in families.split(", "):
            rows[family] = (both == "yes", values == "yes")
    return rows


def test_the_readme_names_every_family_built_here():
    assert sorted(readme_rows()) == sorted(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_takes_the_rotations_the_readme_says_and_refuses_the_others_naming_why(family):
    both, values = readme_rows()[family]
    model = tiny_family(family)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    problems = qw.rotation_problems(model)
    assert ("R1" not in problems) == both and ("R2" not in problems) == values, problems
    for applies, rotation, name in ((both, qw.Rotation(), "R1"), (values, qw.Rotation(residual=False), "R2")):
        if applies:
            rotated = qw.rotate(model, rotation, (ids,))  # refused if its logits moved past float round-off
            assert rotated is not model
        else:
            with pytest.raises(qw.InvalidSettingsError, match=f"{name} does not apply: .+"):
                qw.rotate(model, rotation, (ids,))
