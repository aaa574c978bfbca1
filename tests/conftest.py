from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from torch.ao.quantization import QConfigMapping, default_qconfig, get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import prepare_fx

from qreport_widgets.demo.cache import CACHE_VARIABLE, cache_folder

torch.manual_seed(0)


def _read_every_output_message() -> None:
    """nbval waits for a cell's reply before it reads the cell's output messages, and a ZeroMQ queue
    holds 1,000 of them by default: a widget of thousands of parts (a 30-block decoder's Tune rows,
    one message each) overflows it, the messages past it are dropped, the cell's end among them, and
    nbval fails the cell waiting. JupyterLab reads them as they come (the browser tests run such a
    widget). The kernels' clients here queue every message instead."""
    try:
        import zmq
        from jupyter_client import KernelManager
    except ImportError:
        return
    make_client = KernelManager.client

    def client(self, **kwargs):
        made = make_client(self, **kwargs)
        made.context.setsockopt(zmq.RCVHWM, 0)  # before its channels' sockets are made: none is bounded
        return made

    KernelManager.client = client


_read_every_output_message()


def prepared(model: torch.nn.Module, example, mapping: QConfigMapping | None = None):
    """A prepare_fx copy of ``model`` (the original is left alone)."""
    mapping = mapping if mapping is not None else QConfigMapping().set_global(default_qconfig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare_fx(copy.deepcopy(model).eval(), mapping, example)


def run(model, batches):
    with torch.no_grad():
        for batch in batches:
            model(*batch)


def fingerprint(model: torch.nn.Module) -> tuple[dict, str, str | None, list[bool]]:
    """What must not change in a caller's float model: parameters and buffers (values and dtypes),
    structure, traced graph code (None when plain FX cannot trace it) and train / eval flags."""
    try:
        code = torch.fx.symbolic_trace(model).code
    except Exception:
        code = None
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return state, str(model), code, [m.training for m in model.modules()]


def assert_unchanged(model: torch.nn.Module, before: tuple[dict, str, str | None, list[bool]]) -> None:
    state, text, code, training = before
    after_state, after_text, after_code, after_training = fingerprint(model)
    assert list(after_state) == list(state)
    for name, value in after_state.items():
        assert value.dtype == state[name].dtype and torch.equal(value, state[name]), name
    assert after_text == text and after_code == code and after_training == training


@pytest.fixture
def x86_mapping():
    return get_default_qconfig_mapping("x86")


# trained weights kept with the tests (the text decoder alone trains for a minute on two cores):
# tests/test_digits.py checks they are the current recipes' files, the digits models' tests train
# each again, and `make test-slow` the text decoder
COMMITTED_WEIGHTS = Path(__file__).parent / "weights"


def pytest_report_header(config):
    """Which SIMD level each library runs at: a failure seen on one CPU and not another starts here."""
    from qreport_widgets.core.cpu import cpu_simd

    return f"cpu: {cpu_simd()}"


def pytest_configure(config):
    """One folder for the trained demo models of the whole run, the notebooks' kernels included
    (they inherit the environment): each model is trained once (seeded, so every test sees the
    same weights) and loaded from there after; the weights in ``tests/weights`` are put there
    first. A ``QREPORT_WIDGETS_CACHE`` already set is kept (a developer's repeated runs skip the
    training); else a fresh folder per run, removed when it ends."""
    _threads_per_worker()
    if not os.environ.get(CACHE_VARIABLE):
        os.environ[CACHE_VARIABLE] = tempfile.mkdtemp(prefix="qreport-demo-weights-")
        config.stash[_MADE_CACHE] = Path(os.environ[CACHE_VARIABLE])
    folder = Path(os.environ[CACHE_VARIABLE])
    folder.mkdir(parents=True, exist_ok=True)
    for weights in COMMITTED_WEIGHTS.glob("*.pt"):
        if not (folder / weights.name).exists():
            shutil.copyfile(weights, folder / weights.name)


def pytest_unconfigure(config):
    """The run's own weights folder (made in ``pytest_configure``) removed when the run ends."""
    made = config.stash.get(_MADE_CACHE, None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        os.environ.pop(CACHE_VARIABLE, None)


_MADE_CACHE = pytest.StashKey[Path]()


def _threads_per_worker() -> None:
    """Under ``pytest -n N`` (``make test``: the files shared among workers), each worker takes its
    share of the cores, and so do the processes it starts (notebook kernels, ranks, the runtime's)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.fixture(scope="session")
def digits_cache():
    return cache_folder()


@pytest.fixture(scope="session")
def text_decoder(digits_cache):
    """The byte-level decoder trained on the Python reference's help topics (its weights from
    ``tests/weights``) and its held-out text."""
    from qreport_widgets.demo.text import trained_text_decoder

    return trained_text_decoder(cache_dir=digits_cache)


def text_decoder_report(text_decoder, **overrides):
    """``analyze`` of the trained byte decoder on the eager engine: its calibration and evaluation
    text, every Linear starting int4 group 128, perplexity the metric (``overrides`` replace these)."""
    import qreport_widgets as qw

    model, data = text_decoder
    given = {"engine": "eager", "format": "int4-weight-only", "group_size": 128, "metric": "perplexity", **overrides}
    return qw.analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation, progress=False, **given)


# notebook -> the (module, extra) pairs it runs; its cells are skipped where one is not installed
NOTEBOOK_EXTRAS = {
    "11_deploy_to_a_phone.ipynb": (("executorch", "executorch"), ("model_explorer", "explorer")),
    "13_a_language_model_on_a_phone.ipynb": (("executorch", "executorch"),),
    "14_a_decoder_in_llama_cpp.ipynb": (("llama_cpp", "llamacpp"), ("gguf", "llamacpp")),
    "15_your_pretrained_decoder.ipynb": (("compressed_tensors", "checkpoint"), ("llama_cpp", "llamacpp"), ("gguf", "llamacpp")),
}


# notebooks run by `make test-slow` only: minutes of lowering, each claim tested at smaller cost elsewhere
SLOW_NOTEBOOKS = {
    # seven ExecuTorch programs of the trained decoder (about 7 minutes); the baseline against an independent
    # program, GPTQ in the runtime and decode speed: tests/test_eager_xnnpack.py, the fit: tests/test_mixed_precision.py
    "13_a_language_model_on_a_phone.ipynb",
    # two ExecuTorch programs of the digits CNN, a reach and a Model Explorer export (about 45 s): the program
    # against the runtime, the truth check, reach and the written .pte: tests/test_xnnpack.py; the export:
    # tests/test_model_explorer.py
    "11_deploy_to_a_phone.ipynb",
    # eight int4 runs of the trained decoder, its block sensitivity and a fit (about 35 s): the algorithms'
    # runs and perplexity, blocks and fit by block: tests/test_weight_algorithms.py
    "12_a_language_model_in_int4.ipynb",
    # the trained decoder as GGUF files in llama.cpp, llama.cpp's own quantization and a fit within its bytes:
    # the runs, blocks read in llama.cpp, the truth check and the fit: tests/test_llamacpp_target.py
    "14_a_decoder_in_llama_cpp.ipynb",
    # SmolLM2-135M from its GGUF: blocks, a fit, a checkpoint and a GGUF file (about ten minutes): the
    # quick start's path, tests/test_readme.py (slow too); the checkpoint: tests/test_checkpoint.py
    "15_your_pretrained_decoder.ipynb",
}


# notebooks the browser tests (tests/browser) open in JupyterLab and run cell by cell, failing on a cell
# that raises: where those tests run (Chromium installed and the tests collected), nbval does not run
# them a second time
BROWSER_NOTEBOOKS = {
    "01_quickstart.ipynb",
    "06_a_54_layer_model.ipynb",
    "08_when_the_simulation_disagrees.ipynb",
    "09_a_transformer.ipynb",
    "10_size_budget.ipynb",
}


def _browser_runs_notebooks(items) -> bool:
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    return os.path.exists(chromium) and any(item.path.name == "test_quickstart_browser.py" for item in items)


# the files that take longest (minutes of ExecuTorch lowering, a browser, trained decoders), collected
# first: ``make test`` hands whole files to its workers in collection order (``--no-loadscope-reorder``:
# xdist's own order is most tests first), and a long file handed out last would leave one worker running
# alone at the end
LONGEST_FIRST = (  # each 80 to 450 s of one worker in `make test` on 2 cores, longest first
    "test_eager_xnnpack.py",
    "test_quickstart_browser.py",
    "test_distributed.py",
    "test_xnnpack.py",
    "test_program_reuse.py",
    "test_shortcut_properties.py",
    "test_pt2e_engine.py",
    "test_untunable_weights.py",
    "test_learned_rounding.py",
)


def pytest_collection_modifyitems(config, items):
    """Notebooks that need an optional extra skip, cell by cell, where it is not installed (the tests
    of an extra skip at import, ``pytest.importorskip``); the slow notebooks' cells are marked slow;
    the notebooks the browser tests run are left to them where they run; the longest files first
    (``LONGEST_FIRST``), each file's tests in their order."""
    items.sort(key=lambda item: LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST else len(LONGEST_FIRST))
    if _browser_runs_notebooks(items):
        covered = [item for item in items if item.path.name in BROWSER_NOTEBOOKS]
        if covered:
            config.hook.pytest_deselected(items=covered)
            items[:] = [item for item in items if item.path.name not in BROWSER_NOTEBOOKS]
    for item in items:
        if item.path.name in SLOW_NOTEBOOKS:
            item.add_marker(pytest.mark.slow)
        for module, extra in NOTEBOOK_EXTRAS.get(item.path.name, ()):
            if importlib.util.find_spec(module) is None:
                item.add_marker(pytest.mark.skip(reason=f"the [{extra}] extra is not installed"))
                break


# The decoder tests and the eager engine's XNNPACK tests run in the check mode (core/shortcuts.py; the
# PT2E engine's, test_xnnpack.py, take twice as long in it, and test their traced patterns against
# tracing each time themselves): every shortcut their sessions take (a program rewritten, GPTQ weights
# found before, an input quantized once for its readers, a simulation's known variants and replayed
# blocks, a fit's halving) also computes its answer afresh and raises where they differ.
# QREPORT_CHECK_SHORTCUTS set in the environment (0 or 1) decides for every file instead (the
# Makefile's kernel reruns set 0). A test of what a shortcut saves (a pass not run, a lowering's time)
# or that lowers afresh itself asks for ``shortcuts_as_taken``: the check mode would spend it again.
CHECKED_FILES = (
    "test_program_reuse.py",  # (tests/test_eager_xnnpack.py's rewrite is this file's: its fresh lowering is not paid twice)
    "test_text_decoder.py",
    "test_eager_replay.py",
    "test_weight_algorithms.py",
    "test_learned_rounding.py",
    "test_rotation.py",
    "test_rotation_families.py",
    "test_mixed_precision.py",
    "test_shortcuts.py",
)


@pytest.fixture(autouse=True)
def _shortcuts_checked(request, monkeypatch):
    from qreport_widgets.core.shortcuts import ENVIRONMENT

    if ENVIRONMENT not in os.environ and request.path.name in CHECKED_FILES:
        monkeypatch.setenv(ENVIRONMENT, "1")


@pytest.fixture
def shortcuts_as_taken(monkeypatch):
    """The shortcuts taken and not checked: for a test of what one saves."""
    from qreport_widgets.core.shortcuts import ENVIRONMENT

    monkeypatch.setenv(ENVIRONMENT, "0")


_CHECKED_COUNTS = pytest.StashKey[dict]()


def pytest_sessionfinish(session):
    """A worker hands the checks it made to the controller (pytest-xdist's ``workeroutput``)."""
    from qreport_widgets.core.shortcuts import CHECKED

    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["shortcuts_checked"] = {shortcut.name: count for shortcut, count in CHECKED.items()}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    counts = node.config.stash.setdefault(_CHECKED_COUNTS, {})
    for name, count in getattr(node, "workeroutput", {}).get("shortcuts_checked", {}).items():
        counts[name] = counts.get(name, 0) + count


def pytest_terminal_summary(terminalreporter, config):
    """What the check mode checked in this run, by shortcut (none found wrong, or a test failed)."""
    from qreport_widgets.core.shortcuts import CHECKED

    counts = dict(config.stash.get(_CHECKED_COUNTS, {}))
    for shortcut, count in CHECKED.items():
        counts[shortcut.name] = counts.get(shortcut.name, 0) + count
    said = ", ".join(f"{name.lower()} {count}" for name, count in sorted(counts.items())) or "none"
    terminalreporter.write_line(f"shortcuts checked against the answer computed afresh: {said}")
