"""The README's Python snippets run as written: the first, then the session and saving ones after
it (they continue its ``report``), the upstream-workflow one, the PT2E one, the eager one, the
size-front one, the kernel-check one, the XNNPACK one and the phone decoder one on their own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_the_ten_snippets_this_test_runs():
    assert len(snippets()) == 10


XNNPACK_SNIPPETS = (8, 9)  # need the [executorch] extra
# `make test-slow` runs them: the same calls, with their claims checked, run in tests/test_xnnpack.py
# (the CNN's program, its truth check and reach) and tests/test_eager_xnnpack.py (the decoder's 8da4w
# program against an independent one), about 70 s of lowering a second time
COVERED = pytest.mark.slow


@pytest.mark.parametrize(
    "order",
    [(0, 2, 3), (1,), (4,), (5,), (6,), (7,), pytest.param((8,), marks=COVERED), pytest.param((9,), marks=COVERED)],
)
def test_readme_snippets_run_as_written(order, tmp_path, monkeypatch):
    if set(order) & set(XNNPACK_SNIPPETS):
        pytest.importorskip("executorch", reason="the [executorch] extra is not installed")
    monkeypatch.chdir(tmp_path)  # the saving snippet writes demo.qreport here
    namespace: dict = {}
    blocks = snippets()
    for index in order:
        exec(compile(blocks[index], f"README snippet {index}", "exec"), namespace)
    assert "report" in namespace
    if 9 in order:
        assert (tmp_path / "decoder.pte").stat().st_size == namespace["baseline"].size_bytes
    if 3 in order:
        assert (tmp_path / "demo.qreport").exists()
        assert "widget-view+json" in (tmp_path / "demo.html").read_text()


def test_the_llama_cpp_page_snippet_runs_as_written(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp", reason="the [llamacpp] extra is not installed")
    monkeypatch.chdir(tmp_path)  # it writes decoder.gguf here
    (block,) = re.findall(r"```python\n(.*?)```", (README.parent / "docs" / "LLAMACPP.md").read_text(), re.S)
    namespace: dict = {}
    exec(compile(block, "docs/LLAMACPP.md snippet", "exec"), namespace)
    run = namespace["run"]
    assert (tmp_path / "decoder.gguf").stat().st_size == run.deployed_bytes
    assert namespace["LlamaCppModel"]("decoder.gguf").perplexity(namespace["data"].evaluation) == run.eval_metric
    assert len(namespace["session"].block_sqnr(namespace["baseline"])) == 4  # the decoder's blocks, read in llama.cpp
