"""The byte-level decoder trained on real text: it predicts the held-out text far better than byte
frequencies do, its perplexity is what Hugging Face's own loss says, and quantization moves it."""

from __future__ import annotations

import math

import torch

import qreport_widgets as qw
from qreport_widgets.demo.text import HELD_OUT, TOKENS, next_token_nll, text_bytes
from qreport_widgets.engines.settings import ModuleSettings


def test_the_held_out_text_is_never_trained_on(text_decoder):
    _, data = text_decoder
    ids = text_bytes()
    boundary = int(len(ids) * (1 - HELD_OUT))
    held = ids[boundary:]
    windows = [w for batch in data.calibration + data.evaluation for w in batch[0]]
    assert all(w.shape == (TOKENS,) for w in windows)
    starts = {bytes(w[:16].tolist()) for w in windows}
    assert len(starts) == len(windows)  # no window twice
    text = bytes(held.tolist())
    assert all(bytes(w.tolist()) in text for w in windows)


def test_perplexity_is_huggingfaces_own_loss_and_beats_byte_frequencies(text_decoder):
    model, data = text_decoder
    with torch.no_grad():
        losses = [float(model(input_ids=ids, labels=ids).loss) for (ids,) in data.evaluation]
    assert math.isclose(data.perplexity(model), math.exp(sum(losses) / len(losses)), rel_tol=1e-5)
    # what knowing only how often each byte occurs in the training text gives on the same bytes
    ids = text_bytes()
    counts = torch.bincount(ids[: int(len(ids) * (1 - HELD_OUT))], minlength=256).double() + 1
    log_p = (counts / counts.sum()).log()
    targets = torch.cat([ids_[:, 1:].reshape(-1) for (ids_,) in data.evaluation])
    unigram = math.exp(float(-log_p[targets].mean()))
    assert unigram > 15
    assert data.perplexity(model) < unigram / 3


def test_int4_weights_cost_perplexity_and_int8_almost_none(text_decoder):
    model, data = text_decoder
    session = qw.analyze(
        model, data.calibration[0], data.calibration, eval_data=data.evaluation, engine="eager", progress=False
    ).session
    linears = [m.fqn for m in session.modules if m.type_name == "Linear"]
    float_ppl = data.perplexity(model)
    runs = {}
    for name, fmt, group in (("int4 g128", "int4-weight-only", 128), ("int8", "int8-weight-only", None)):
        run = session.apply({fqn: ModuleSettings(format=fmt, group_size=group) for fqn in linears})
        assert run.ok, run.error
        runs[name] = (run, data.perplexity(run.quantized_model))
    int4, int8 = runs["int4 g128"], runs["int8"]
    assert int4[1] > float_ppl and int4[1] > int8[1]
    assert abs(int8[1] - float_ppl) < 0.01 * float_ppl
    assert int4[0].output_sqnr_db < int8[0].output_sqnr_db
    total, count = next_token_nll(int8[0].quantized_model, data.evaluation)  # the latest run's model is kept
    assert math.isclose(math.exp(total / count), int8[1])
