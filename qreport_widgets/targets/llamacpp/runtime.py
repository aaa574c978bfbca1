"""llama.cpp itself, through its Python binding (``llama-cpp-python``), in a worker process.

``LlamaCppModel(path)`` opens a GGUF file in the worker (its bytes' SHA-256 taken when opened, and
checked again should a crash make a new worker open it again) and gives what llama.cpp computes on
token ids: logits per position (``logits``), perplexity as the session computes it from them
(``perplexity``), and prompt / generation speed (``speed``). ``quantize`` is llama.cpp's own
quantization of a GGUF file (``llama_model_quantize``), with an importance matrix when given: what
``llama-quantize --imatrix`` writes. A native abort in llama.cpp ends the worker, not the caller.

llama.cpp runs as its users run it: its own defaults (an F16 KV cache; every core; flash attention
as the binding leaves it), one sequence at a time, its context as long as the longest row.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import os
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import torch

from ...core.metrics import perplexity
from ...errors import MissingExtraError, QReportError
from ..worker import RuntimeFailedError, Worker, answer, serving
from .blocks import GgufFormat

# files the worker keeps open at once (each holds its context: a KV cache, a row of logits a position);
# the one used longest ago is closed for a new one, and opened again, its bytes checked, when next used
HELD_FILES = 4
INSTALL = "pip install 'qreport-widgets[llamacpp]' (llama-cpp-python builds llama.cpp from source: a few minutes)"


class LlamaCppError(QReportError, RuntimeError):
    """llama.cpp refused a file or a request; its own words are in the message."""


def _binding() -> Any:
    try:
        import llama_cpp
    except ImportError as error:
        raise MissingExtraError(f"running a GGUF file needs llama.cpp's Python binding: {INSTALL}") from error
    return llama_cpp


def digest(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes."""
    found = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            found.update(chunk)
    return found.hexdigest()


class LlamaCppWorker(Worker):
    """llama.cpp in a process of its own, holding the files opened in it."""

    runtime = "llama.cpp"
    module = __name__
    hint = "It was a native abort (llama.cpp asserts on what it cannot run): the message above names the file."

    def __init__(self) -> None:
        super().__init__()
        self._opened: collections.OrderedDict[int, None] = collections.OrderedDict()  # held now, the last used last
        self._keys = itertools.count(1)

    def open(self, path: Path, context: int) -> int:
        key = next(self._keys)
        self._holding(key, path, context)
        return key

    def _holding(self, key: int, path: Path, context: int) -> None:
        with self._lock:
            if key in self._opened and self._process is not None:
                self._opened.move_to_end(key)
                return
            while len(self._opened) >= HELD_FILES:
                oldest = next(iter(self._opened))
                self._ask(("close", oldest), lambda: "closing a file")
                del self._opened[oldest]
            self._ask(("open", key, str(path), context), lambda: f"loading {path}")
            self._opened[key] = None

    def request(self, key: int, path: Path, context: int, request: tuple, doing: str) -> Any:
        with self._lock:
            self._holding(key, path, context)
            return self._ask((request[0], key, *request[1:]), lambda: f"{doing} with {path}")

    def holds(self, key: int) -> bool:
        """Whether the current worker has file ``key`` open (a new worker opens it again)."""
        return key in self._opened and self._process is not None

    def close(self, key: int) -> None:
        with self._lock:
            if key in self._opened and self._process is not None:
                self._ask(("close", key), lambda: "closing a file")
            self._opened.pop(key, None)

    def quantize(self, source: Path, destination: Path, options: Mapping[str, Any], imatrix: Mapping[str, Any] | None) -> None:
        self._ask(("quantize", str(source), str(destination), dict(options), imatrix), lambda: f"quantizing {source}")

    def _ended(self) -> None:
        super()._ended()
        self._opened = collections.OrderedDict()


def llama_worker() -> LlamaCppWorker:
    """The process's one ``LlamaCppWorker``."""
    return LlamaCppWorker.shared()


@dataclass(frozen=True)
class Speed:
    """llama.cpp's speed on one prompt: prompt tokens a second (prefill) and generated tokens a second
    (decode, greedy, one at a time after the prompt), timed inside the worker."""

    prompt_tokens: int
    new_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


class LlamaCppModel:
    """A GGUF file opened in llama.cpp (in the worker): ``logits`` on token ids, ``perplexity``,
    ``speed``. ``context``: the longest row it is given (default: the file's training context)."""

    def __init__(self, path: str | os.PathLike[str], context: int = 0) -> None:
        _binding()
        self.path = Path(path).resolve()  # the worker's working folder is the one it started in
        if not self.path.is_file():
            raise LlamaCppError(f"{self.path} is not a file")
        self.digest = digest(self.path)
        self.bytes = self.path.stat().st_size
        self.context = context
        worker = llama_worker()
        try:
            self._key = worker.open(self.path, context)
        except RuntimeError as error:
            raise LlamaCppError(f"llama.cpp could not load {self.path}: {error}") from None
        weakref.finalize(self, _closed, worker, self._key)

    def _ask(self, request: tuple, doing: str) -> Any:
        worker = llama_worker()
        if not worker.holds(self._key) and digest(self.path) != self.digest:
            raise LlamaCppError(f"{self.path} changed since it was opened: open it again (LlamaCppModel)")
        try:
            return worker.request(self._key, self.path, self.context, request, doing)
        except RuntimeFailedError:
            raise
        except RuntimeError as error:
            raise LlamaCppError(f"llama.cpp failed {doing} with {self.path}: {error}") from None

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """llama.cpp's logits (rows x positions x vocabulary, float32) for token ids ``tokens``
        (rows x positions, or one row), each row a sequence of its own from an empty cache."""
        rows = tokens.reshape(-1, tokens.shape[-1]) if tokens.dim() > 1 else tokens.reshape(1, -1)
        found = [self._ask(("logits", [int(t) for t in row]), f"computing logits of {rows.shape[1]} tokens") for row in rows]
        out = torch.from_numpy(numpy.stack(found))
        return out.reshape(*tokens.shape, out.shape[-1])

    def __call__(self, input_ids: torch.Tensor, **_ignored: Any) -> torch.Tensor:
        """The logits of ``input_ids``, called as a causal language model is (what the session's
        metrics call: ``core.metrics.perplexity(llama, batches)`` is this file's perplexity)."""
        return self.logits(input_ids)

    def perplexity(self, batches: Iterable[Any]) -> float:
        """exp(mean negative log-likelihood of each next token) on ``batches`` of token ids, from
        llama.cpp's logits, with the session's own perplexity (``core.metrics.perplexity``)."""
        return perplexity(self, batches)

    def tokenize(self, text: str | bytes) -> list[int]:
        """llama.cpp's tokens of ``text`` (the file's tokenizer, no beginning-of-text token added)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return list(self._ask(("tokenize", data), "tokenizing text"))

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The bytes llama.cpp's tokenizer gives back for ``tokens``."""
        return bytes(self._ask(("detokenize", [int(t) for t in tokens]), "detokenizing"))

    def block_outputs(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Each block's output (its hidden states after the residual, ``l_out``) as llama.cpp computes
        ``tokens`` (rows x positions, or one row; each row from an empty cache): one tensor of rows x
        positions x width a block, read through llama.cpp's evaluation callback."""
        rows = tokens.reshape(-1, tokens.shape[-1]) if tokens.dim() > 1 else tokens.reshape(1, -1)
        per_row = [
            self._ask(("taps", [int(t) for t in row], "l_out-"), f"reading the blocks' outputs of {rows.shape[1]} tokens")
            for row in rows
        ]
        count = len(per_row[0])
        if any(f"l_out-{i}" not in taps for taps in per_row for i in range(count)):
            raise LlamaCppError("llama.cpp's graph names its blocks' outputs otherwise (no l_out-N): cannot read them")
        return [torch.from_numpy(numpy.stack([taps[f"l_out-{i}"] for taps in per_row])) for i in range(count)]

    def speed(self, prompt: Sequence[int], new_tokens: int = 32) -> Speed:
        """Prefill and greedy decode speed on ``prompt`` (then ``new_tokens`` generated)."""
        prefill_s, decode_s = self._ask(("speed", [int(t) for t in prompt], int(new_tokens)), "timing generation")
        return Speed(len(prompt), new_tokens, len(prompt) / prefill_s, new_tokens / decode_s)


def _closed(worker: LlamaCppWorker, key: int) -> None:
    try:
        worker.close(key)
    except Exception:  # the worker is gone: nothing held
        pass


# llama.cpp's file types ``quantize`` writes (``llama_ftype``), by the name its tools use
QUANTIZE_TYPES = {
    "Q4_0": "MOSTLY_Q4_0",
    "Q4_1": "MOSTLY_Q4_1",
    "Q8_0": "MOSTLY_Q8_0",
    "F16": "MOSTLY_F16",
    "Q4_K_S": "MOSTLY_Q4_K_S",
    "Q4_K_M": "MOSTLY_Q4_K_M",
    "Q5_K_M": "MOSTLY_Q5_K_M",
    "Q6_K": "MOSTLY_Q6_K",
}


def quantize(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    kind: str,
    *,
    imatrix: Mapping[str, torch.Tensor] | None = None,
    pure: bool = False,
    output_type: GgufFormat | str | None = None,
    embedding_type: GgufFormat | str | None = None,
    overwrite: bool = False,
) -> Path:
    """llama.cpp's own quantization of ``source`` (a GGUF file, F16 / F32) as ``kind`` (``"Q4_0"``,
    ``"Q4_K_M"``...), as ``llama-quantize`` does: ``imatrix`` the mean squared input of each column
    per GGUF tensor name (llama-imatrix's ``in_sum2 / counts``), ``pure`` every tensor ``kind``,
    ``output_type`` / ``embedding_type`` those two tensors' formats. Written next to ``destination``
    and moved there once whole."""
    _binding()
    if kind not in QUANTIZE_TYPES:
        raise ValueError(f"kind is one of {', '.join(QUANTIZE_TYPES)}, not {kind!r}")
    destination, source = Path(destination).resolve(), Path(source).resolve()
    if destination.exists() and not overwrite:
        raise LlamaCppError(f"{destination} exists; pass overwrite=True to replace it")
    partial = destination.with_name(f".{destination.name}.partial")
    options = {
        "ftype": _file_type(kind),
        "pure": pure,
        "output_tensor_type": _ggml_type(output_type),
        "token_embedding_type": _ggml_type(embedding_type),
    }
    arrays = None if imatrix is None else {name: v.detach().float().cpu().numpy() for name, v in imatrix.items()}
    try:
        llama_worker().quantize(source, partial, options, arrays)
        os.replace(partial, destination)
    except RuntimeError as error:
        partial.unlink(missing_ok=True)
        if isinstance(error, RuntimeFailedError):
            raise
        raise LlamaCppError(f"llama.cpp could not quantize {source} as {kind}: {error}") from None
    return destination


def _file_type(kind: str) -> int:
    import gguf

    return int(gguf.LlamaFileType[QUANTIZE_TYPES[kind]])


def _ggml_type(format: GgufFormat | str | None) -> int | None:
    """llama.cpp's ``ggml_type`` number of a tensor format named as its tools name it (None: the file type's choice)."""
    if format is None:
        return None
    import gguf

    name = format.value if isinstance(format, GgufFormat) else str(format)
    return int(gguf.GGMLQuantizationType[name])


def serve() -> None:  # pragma: no cover - runs in the worker process
    """The worker's loop: open files, compute logits, time generation, quantize."""
    connection = serving()
    try:
        llama_cpp = _binding()
        said: collections.deque[str] = collections.deque(maxlen=8)  # llama.cpp's last errors, for the reply

        def logged(level: int, text: bytes, _data: Any) -> None:
            if level in (3, 4):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
                said.append(text.decode("utf-8", "replace").strip())

        callback = llama_cpp.llama_log_callback(logged)  # held: llama.cpp calls it while the worker serves
        llama_cpp.llama_log_set(callback, None)
        llama_cpp.llama_backend_init()
    except Exception as error:
        connection.send(("error", f"{type(error).__name__}: {error}"))
        return
    connection.send(("ready", None))
    opened: dict[int, Any] = {}
    threads = os.cpu_count() or 1

    def handle(request: tuple) -> Any:
        said.clear()
        try:
            return handled(request)
        except Exception as error:
            words = "; ".join(line for line in said if line)
            raise type(error)(f"{error}{' (llama.cpp: ' + words + ')' if words else ''}") from None

    def handled(request: tuple) -> Any:
        kind = request[0]
        if kind == "open":
            _, key, path, context = request
            opened[key] = llama_cpp.Llama(
                path,
                n_ctx=context or 0,
                n_batch=max(context, 512),
                n_ubatch=max(context, 512),
                logits_all=True,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
            )
            return None
        if kind == "close":
            model = opened.pop(request[1], None)
            if model is not None:
                model.close()
            return None
        if kind == "logits":
            _, key, tokens = request
            model = opened[key]
            if len(tokens) > model.n_ctx():
                raise ValueError(f"a row of {len(tokens)} tokens is longer than the context of {model.n_ctx()}")
            model.reset()
            model.eval(tokens)
            return numpy.array(model.scores[: len(tokens)], dtype=numpy.float32)
        if kind == "tokenize":
            _, key, text = request
            return opened[key].tokenize(text, add_bos=False, special=False)
        if kind == "detokenize":
            _, key, tokens = request
            return opened[key].detokenize(tokens)
        if kind == "speed":
            _, key, prompt, new_tokens = request
            model = opened[key]
            model.reset()
            start = time.perf_counter()
            model.eval(prompt)
            prefill = time.perf_counter() - start
            token = int(numpy.argmax(model.scores[len(prompt) - 1]))
            start = time.perf_counter()
            for _ in range(new_tokens):
                model.eval([token])
                token = int(numpy.argmax(model.scores[model.n_tokens - 1]))
            return prefill, time.perf_counter() - start
        if kind == "taps":
            _, key, tokens, prefix = request
            return _tapped(llama_cpp, opened[key], tokens, prefix, threads)
        if kind == "quantize":
            _, source, destination, options, imatrix = request
            return _quantized(llama_cpp, source, destination, options, imatrix, threads)
        raise ValueError(f"unknown request {kind!r}")

    answer(connection, handle)


def _tapped(llama_cpp: Any, model: Any, tokens: Sequence[int], prefix: str, threads: int) -> dict[str, numpy.ndarray]:
    """The F32 tensors of llama.cpp's graph whose names start with ``prefix`` (``"l_out-"``: each
    block's output), as it computes ``tokens`` (one sequence, every position an output), read through
    the scheduler's evaluation callback in a context of their own: name -> positions x width."""
    import ctypes

    library = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    library.ggml_get_name.restype, library.ggml_get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    library.ggml_nbytes.restype, library.ggml_nbytes.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
    library.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    found: dict[str, numpy.ndarray] = {}

    def wanted(tensor: int) -> bool:
        return library.ggml_get_name(tensor).decode().startswith(prefix) and ctypes.c_int32.from_address(tensor).value == 0

    def seen(tensor: int, ask: bool, _data: Any) -> bool:
        if ask:
            return wanted(tensor)
        if wanted(tensor):  # type F32 (0); ne[0], ne[1] at 16 and 24 in ggml_tensor, after its type and buffer
            width, rows = (ctypes.c_int64.from_address(tensor + offset).value for offset in (16, 24))
            out = numpy.empty((rows, width), dtype=numpy.float32)
            library.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
            found[library.ggml_get_name(tensor).decode()] = out
        return True

    callback = llama_cpp.ggml_backend_sched_eval_callback(seen)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = max(len(tokens), 32)
    params.n_threads = params.n_threads_batch = threads
    params.cb_eval = callback
    context = llama_cpp.llama_init_from_model(model.model, params)
    if not context:
        raise RuntimeError("llama.cpp could not make a context to read its tensors in")
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for position, token in enumerate(tokens):  # one sequence, every position an output
            batch.token[position], batch.pos[position] = int(token), position
            batch.n_seq_id[position], batch.seq_id[position][0], batch.logits[position] = 1, 0, True
        if llama_cpp.llama_decode(context, batch) != 0:
            raise RuntimeError(f"llama.cpp failed to compute {len(tokens)} tokens")
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(context)
    return found


def _quantized(
    llama_cpp: Any, source: str, destination: str, options: dict, imatrix: dict | None, threads: int
) -> None:  # pragma: no cover
    import ctypes

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = options["ftype"]
    params.pure = options["pure"]
    if options["output_tensor_type"] is not None:  # else llama.cpp's choice for the file type
        params.output_tensor_type = options["output_tensor_type"]
    if options["token_embedding_type"] is not None:
        params.token_embedding_type = options["token_embedding_type"]
    held = []
    if imatrix:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, values) in enumerate(imatrix.items()):
            data = numpy.ascontiguousarray(values, dtype=numpy.float32)
            encoded = name.encode()
            held += [data, encoded]
            entries[i].name = encoded
            entries[i].data = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = data.size
        entries[len(imatrix)].name = None
        held.append(entries)
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    code = llama_cpp.llama_model_quantize(source.encode(), destination.encode(), ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama_model_quantize returned {code}")
