"""Task accuracy from lm-evaluation-harness as the session's metric, offline: a multiple-choice task
written from the byte decoder's held-out text (``tasks/python_reference.py``), scored by the harness
through ``TaskAccuracy`` on the float model, on runs, and as the target of ``fit``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import qreport_widgets as qw
from qreport_widgets.core.tasks import TaskAccuracy, TaskError, write_task

pytest.importorskip("lm_eval")
sys.path.insert(0, str(Path(__file__).parent / "tasks"))
from python_reference import items  # noqa: E402

TASK = "python_reference"


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory):
    return write_task(tmp_path_factory.mktemp("tasks"), TASK, items())


def by_hand(model, found: list[dict]) -> float:
    """The fraction of items whose right answer has the highest log-likelihood, computed here."""
    right = 0
    for item in found:
        context = encode(item["context"])
        scores = []
        for choice in item["choices"]:
            ids = torch.tensor([context + encode(choice)])
            with torch.no_grad():
                logprobs = torch.log_softmax(model(ids[:, :-1]).logits.float(), -1)[0]
            answer = ids[0, len(context) :]
            scores.append(float(logprobs[len(context) - 1 :].gather(1, answer[:, None]).sum()))
        right += max(range(len(scores)), key=scores.__getitem__) == item["answer"]
    return right / len(found)


def test_the_harness_scores_the_local_task_as_the_log_likelihoods_computed_by_hand(text_decoder, task_folder):
    model, _ = text_decoder
    accuracy = TaskAccuracy([TASK], encode, include_path=task_folder)
    score = accuracy(model)
    assert score == pytest.approx(by_hand(model, items()))
    assert score > 0.8  # four spellings: the trained decoder knows its text's words (chance is 0.25)
    assert accuracy.evaluations == 1 and accuracy.metric.higher_is_better


def test_fit_on_task_accuracy_finds_a_mix_within_the_budget_its_score_confirmed_by_the_harness(text_decoder, task_folder):
    model, data = text_decoder
    accuracy = TaskAccuracy([TASK], encode, include_path=task_folder, limit=24)
    session = qw.analyze(
        model, data.calibration[0], data.calibration, eval_data=data.evaluation[:2], engine="eager",
        format="int4-weight-only", group_size=32, eval_fn=accuracy, metric=accuracy.metric, progress=False,
    ).session  # fmt: skip
    floats = session.float_metric()
    budget = session.baseline().deployed_bytes * 1.3
    run = session.fit(max_size_bytes=budget, target_metric=floats, progress=False)
    assert run.ok and run.deployed_bytes <= budget
    assert run.eval_metric == accuracy(run.quantized_model)  # the harness again, on the run's model
    said = next(note for note in run.notes if "with the session's eval_fn" in note)
    spent = int(said.split("this fit scored ")[1].split(" model")[0])
    assert 1 <= spent <= 40


def test_tasks_that_cannot_be_scored_from_logits_or_found_are_refused_naming_why(text_decoder, tmp_path):
    model, _ = text_decoder
    with pytest.raises(TaskError, match="include_path= a folder with the task's YAML"):
        TaskAccuracy(["no_such_task_here"], encode, include_path=tmp_path)(model)
    with pytest.raises(TaskError, match="answer=4 is not the index"):
        write_task(tmp_path, "bad", [{"context": "a", "choices": ["b", "c"], "answer": 4}])
    with pytest.raises(TaskError, match="takes a list of task names"):
        TaskAccuracy("arc_easy", encode)


def test_the_tasks_page_snippet_runs_as_written(tmp_path, monkeypatch):
    import re

    monkeypatch.chdir(tmp_path)  # it writes its task into tasks/ here
    page = Path(__file__).resolve().parents[1] / "docs" / "TASKS.md"
    (block,) = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    namespace: dict = {}
    exec(compile(block, "docs/TASKS.md snippet", "exec"), namespace)
    accuracy, session = namespace["accuracy"], namespace["session"]
    assert session.float_metric() == 1.0  # the trained decoder spells both words
    assert accuracy.evaluations == 2 and (tmp_path / "tasks" / "spelling.yaml").exists()
