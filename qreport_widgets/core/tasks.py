"""Task accuracy as a session's metric: lm-evaluation-harness tasks (the ``[tasks]`` extra).

Model cards and papers judge a quantized decoder by task accuracy (ARC, HellaSwag, PIQA, WinoGrande,
MMLU) beside perplexity. ``TaskAccuracy`` is an ``eval_fn`` that scores a model on lm-evaluation-
harness tasks, by name (the harness's own, whose data it fetches from the Hugging Face hub) or from
a folder of task YAML files and local JSON / JSONL data (``include_path``, offline):

    accuracy = TaskAccuracy(["my_task"], tokenizer, include_path="tasks/", limit=200)
    report = analyze(model, ..., engine="eager", eval_fn=accuracy, metric=accuracy.metric)
    run = report.session.fit(max_size_bytes=..., target_metric=0.60)

The harness asks a model for the log-likelihood of each answer given its question; here the models
the session measures answer (the float model, the simulation's, a run's), each given rows of the
token ids ``tokenizer`` makes, right-padded to the longest, and returning logits. Tasks that
generate text or score whole documents are refused with the reason: the size front and ``fit``
need a score from logits. ``evaluations`` counts the models scored.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import MissingExtraError, QReportError
from .metrics import Metric

MEASURES = ("acc", "acc_norm")  # what a multiple-choice task reports per item


class TaskError(QReportError, ValueError):
    """A task that cannot be scored here; the message says why and what to do."""


class TaskAccuracy:
    """``eval_fn(model) -> float``: the mean of ``measure`` ("acc" or "acc_norm") over ``tasks``.

    ``tokenizer``: a transformers tokenizer, or any ``text -> list of token ids`` (a byte model's
    ``lambda text: list(text.encode())``). ``include_path``: a folder of task YAML files (their
    ``dataset_path: json`` with ``data_files`` for data on disk). ``limit``, ``num_fewshot``: as the
    harness takes them (items per task, examples in each prompt). ``max_length``: the longest
    sequence the model takes (longer prompts lose their start); ``batch_size``: sequences a call."""

    def __init__(
        self,
        tasks: Sequence[str],
        tokenizer: Any,
        *,
        include_path: str | os.PathLike | None = None,
        limit: int | float | None = None,
        num_fewshot: int | None = None,
        measure: str = "acc",
        max_length: int = 2048,
        batch_size: int = 8,
    ) -> None:
        if isinstance(tasks, str) or not tasks:
            raise TaskError(f"tasks= takes a list of task names, not {tasks!r}")
        if measure not in MEASURES:
            raise TaskError(f"measure={measure!r}: a multiple-choice task reports one of {', '.join(MEASURES)}")
        if include_path is not None and not os.path.isdir(include_path):
            raise TaskError(f"include_path={str(include_path)!r} is not a folder of task YAML files")
        self.tasks, self.include_path, self.limit, self.num_fewshot = list(tasks), include_path, limit, num_fewshot
        self.measure, self.max_length, self.batch_size = measure, max_length, batch_size
        self.encode = _encoder(tokenizer)
        self.evaluations = 0
        self.last_scores: dict[str, float] = {}
        self._manager: Any = None

    @property
    def metric(self) -> Metric:
        """What this eval_fn measures, for ``analyze(..., metric=)``: higher is better."""
        return Metric(f"{self.measure} ({', '.join(self.tasks)})", higher_is_better=True)

    def __call__(self, model: Any) -> float:
        scores = self.scores(model)
        return float(sum(scores.values()) / len(scores))

    def scores(self, model: Any) -> dict[str, float]:
        """Each task's ``measure`` of ``model``, as the harness computes it."""
        evaluator, manager = self._harness()
        answering = _answering_class()(model, self.encode, self.max_length, self.batch_size)
        quiet = logging.getLogger("lm-eval"), logging.getLogger("lm_eval")
        levels = [log.level for log in quiet]
        try:
            for log in quiet:
                log.setLevel(logging.ERROR)
            results = evaluator.simple_evaluate(
                model=answering,
                tasks=self.tasks,
                num_fewshot=self.num_fewshot,
                limit=self.limit,
                task_manager=manager,
                log_samples=False,
                bootstrap_iters=0,
                verbosity="ERROR",
            )
        except TaskError:
            raise
        except Exception as error:  # the harness's own errors: a task it cannot find or load
            raise TaskError(
                f"lm-evaluation-harness could not run {', '.join(self.tasks)} ({type(error).__name__}: {error}). A task "
                "by name reads its data from the Hugging Face hub; offline, give include_path= a folder with the "
                "task's YAML and its data on disk"
            ) from error
        finally:
            for log, level in zip(quiet, levels, strict=True):
                log.setLevel(level)
        self.evaluations += 1
        found = results["results"]
        scores = {}
        for task in self.tasks:
            value = found.get(task, {}).get(f"{self.measure},none")
            if value is None:
                raise TaskError(f"task {task!r} reports no {self.measure!r} (it reports {sorted(found.get(task, {}))})")
            scores[task] = float(value)
        self.last_scores = scores
        return scores

    def _harness(self) -> tuple[Any, Any]:
        try:
            from lm_eval import evaluator
            from lm_eval.tasks import TaskManager
        except ImportError as error:
            raise MissingExtraError(
                "TaskAccuracy runs lm-evaluation-harness: pip install 'qreport-widgets[tasks]' (or pip install lm-eval)"
            ) from error
        if self._manager is None:
            path = None if self.include_path is None else str(self.include_path)
            self._manager = TaskManager(include_path=path)
        return evaluator, self._manager


def _encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    if hasattr(tokenizer, "encode"):
        return lambda text: list(tokenizer.encode(text, add_special_tokens=False))
    if callable(tokenizer):
        return lambda text: list(tokenizer(text))
    raise TaskError(f"tokenizer= takes a transformers tokenizer or a function text -> token ids, not {type(tokenizer).__name__}")


@functools.cache
def _answering_class() -> type:
    from lm_eval.api.model import LM

    class Answering(LM):
        """The harness's view of a model that returns logits for token ids."""

        def __init__(self, model: Any, encode: Callable[[str], list[int]], max_length: int, batch_size: int) -> None:
            super().__init__()
            self.model, self.encode, self.max_length, self.size = model, encode, max_length, batch_size

        def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            pairs = [self._pair(*request.args) for request in requests]
            answers: list[tuple[float, bool]] = []
            for start in range(0, len(pairs), self.size):
                answers += self._scored(pairs[start : start + self.size])
            return answers

        def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
            raise TaskError(_REFUSED.format(kind="score whole documents (loglikelihood_rolling)"))

        def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
            raise TaskError(_REFUSED.format(kind="generate text (generate_until)"))

        def _pair(self, context: str, continuation: str) -> tuple[list[int], int]:
            """The ids of context + continuation and how many of them are the continuation's. Spaces
            ending the context move to the continuation, as a tokenizer that merges a space with the
            word after it would write them; the ids are of the whole text, cut after the context's."""
            moved = len(context) - len(context.rstrip(" "))
            if moved:
                context, continuation = context[:-moved], context[-moved:] + continuation
            whole, head = self.encode(context + continuation), self.encode(context)
            if not head:
                raise TaskError("a task item has an empty context: its first answer token would be predicted from nothing")
            answer = len(whole) - len(head)
            if answer <= 0:
                raise TaskError(f"an answer ({continuation!r}) makes no tokens of its own after its context")
            return whole[-(self.max_length + 1) :], answer

        def _scored(self, pairs: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
            from .devices import model_device

            longest = max(len(ids) - 1 for ids, _ in pairs)
            rows = torch.zeros(len(pairs), longest, dtype=torch.long)
            for row, (ids, _) in enumerate(pairs):  # right-padded: a causal model's earlier positions never read the pad
                rows[row, : len(ids) - 1] = torch.tensor(ids[:-1])
            device = model_device(self.model) if isinstance(self.model, torch.nn.Module) else torch.device("cpu")
            with torch.no_grad():
                output = self.model(rows.to(device))
            logits = getattr(output, "logits", output)
            logits = logits[0] if isinstance(logits, (tuple, list)) else logits
            logprobs = torch.log_softmax(logits.float().cpu(), dim=-1)
            answers = []
            for row, (ids, answer) in enumerate(pairs):
                end = len(ids) - 1
                predicted = logprobs[row, end - answer : end]
                targets = torch.tensor(ids[-answer:])
                total = float(predicted.gather(1, targets[:, None]).sum())
                greedy = bool((predicted.argmax(-1) == targets).all())
                answers.append((total if math.isfinite(total) else -math.inf, greedy))
            return answers

    return Answering


_REFUSED = (
    "the task asks the model to {kind}; the session scores models by log-likelihoods of answers "
    "(multiple-choice tasks: ARC, HellaSwag, PIQA, WinoGrande, MMLU, or your own)"
)


def write_task(folder: str | os.PathLike, name: str, items: Sequence[dict[str, Any]]) -> Path:
    """A multiple-choice task of your own for ``TaskAccuracy(include_path=folder)``: ``items`` each
    ``{"context": text, "choices": [answer texts], "answer": index of the right one}``, written to
    ``folder`` as ``name.jsonl`` and the harness's ``name.yaml`` reading it (each answer follows its
    context directly: put the space before an answer in the answer). Returns the folder."""
    if not name.isidentifier():
        raise TaskError(f"task name {name!r}: letters, digits and underscores, not starting with a digit")
    for index, item in enumerate(items):
        choices, answer = item.get("choices"), item.get("answer")
        if not isinstance(item.get("context"), str) or not isinstance(choices, list) or len(choices) < 2:
            raise TaskError(f"item {index}: needs a context (text) and at least two choices (texts)")
        if not isinstance(answer, int) or not 0 <= answer < len(choices):
            raise TaskError(f"item {index}: answer={answer!r} is not the index of one of its {len(choices)} choices")
    place = Path(folder)
    place.mkdir(parents=True, exist_ok=True)
    data = (place / f"{name}.jsonl").resolve()
    data.write_text("".join(json.dumps(item) + "\n" for item in items))
    (place / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        'target_delimiter: ""\n'
        "metric_list:\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return place
