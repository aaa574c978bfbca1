"""A native runtime in a process of its own, so that its crash ends that process and not the caller.

``Worker`` starts a fresh interpreter that runs one module's ``serve()`` (not multiprocessing's spawn,
which would run the caller's script again where it has no main guard), talks to it over a socket
pair with multiprocessing's connection, starts another after a crash and says how the last one
ended. ``serving()`` is the worker side: the connection to answer on. ExecuTorch's runtime
(``engines.executorch``) and llama.cpp (``llamacpp.runtime``) each run in one.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import QReportError

SOCKET, KEY = "QREPORT_WIDGETS_RUNTIME_SOCKET", "QREPORT_WIDGETS_RUNTIME_KEY"  # what a worker is started with


W = TypeVar("W", bound="Worker")
_SHARED: dict[type, Worker] = {}  # each kind's one worker in this process


class RuntimeFailedError(QReportError, RuntimeError):
    """A native runtime failed while it ran a model (it crashed or refused it); nothing of the
    caller's state was changed."""


class Worker:
    """A process running ``module``'s ``serve()``: started when first asked and again after a crash.
    ``runtime`` names it in messages, ``hint`` says what to do after a crash. Subclasses add the
    requests their runtime answers (``_ask``) and drop what the worker held when it ends (``_ended``)."""

    runtime = "the runtime"
    module = ""
    hint = ""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._process: Any = None
        self._connection: Any = None
        self.starts = 0  # processes started (a crash makes the next call start another)

    @classmethod
    def shared(cls: type[W]) -> W:
        """The process's one worker of this kind, made when first asked."""
        found = _SHARED.get(cls)
        if found is None:
            found = _SHARED[cls] = cls()
        return found  # type: ignore[return-value]

    @property
    def pid(self) -> int | None:
        """The worker's process id, while it runs."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def stop(self) -> None:
        """End the worker process (a later call starts another)."""
        with self._lock:
            if self._process is not None:
                with contextlib.suppress(Exception):
                    self._connection.send(("stop",))
                try:
                    self._process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
                self._ended()

    def _ask(self, request: tuple, doing: Callable[[], str]) -> Any:
        """The worker's answer to ``request``; ``RuntimeFailedError`` saying ``doing()`` when it
        crashed, ``RuntimeError`` with the runtime's words when it refused."""
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._ended()
                self._start()
            try:
                self._before(request)
                self._connection.send(request)
                status, value = self._connection.recv()
            except (EOFError, OSError, BrokenPipeError):
                raise RuntimeFailedError(self._crashed(doing())) from None
        if status == "error":
            raise RuntimeError(value)
        return value

    def _before(self, request: tuple) -> None:
        """What a subclass sends ahead of ``request`` (default: nothing)."""

    def _crashed(self, doing: str) -> str:
        try:
            code = self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # the pipe broke but the process lives on: ended here
            self._process.kill()
            code = self._process.wait()
        self._ended()
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        return (
            f"{self.runtime} crashed while {doing}: the worker process it runs in {how}. Your Python session is "
            f"unaffected and the next call runs in a new worker. {self.hint}"
        ).strip()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        key = multiprocessing.current_process().authkey.hex()
        environment = {**os.environ, SOCKET: str(theirs.fileno()), KEY: key}
        process = subprocess.Popen(
            [sys.executable, "-c", f"from {self.module} import serve; serve()"],
            pass_fds=(theirs.fileno(),),
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,  # the runtime's C++ logs; its errors come back as text
        )
        theirs.close()
        connection = multiprocessing.connection.Connection(ours.detach())
        self._process, self._connection = process, connection
        self.starts += 1
        status, value = connection.recv() if connection.poll(120) else ("error", "the worker did not start within 120 s")
        if status != "ready":
            self.stop()
            raise RuntimeFailedError(f"{self.runtime} could not start in its worker process: {value}")

    def _ended(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.close()
        self._process, self._connection = None, None


def serving() -> multiprocessing.connection.Connection:  # pragma: no cover - runs in the worker process
    """The worker side: the connection its caller talks on (the caller's key taken, so that tensors
    it shares through shared memory are handed over after authentication)."""
    multiprocessing.current_process().authkey = bytes.fromhex(os.environ[KEY])
    return multiprocessing.connection.Connection(int(os.environ[SOCKET]))


def answer(connection: multiprocessing.connection.Connection, handle: Callable[[tuple], Any]) -> None:  # pragma: no cover
    """Answer requests with ``handle`` until told to stop or the pipe closes: ``("ok", value)``, or
    ``("error", words)`` for what the runtime refused."""
    while True:
        try:
            request = connection.recv()
        except EOFError:
            return
        if request[0] == "stop":
            return
        try:
            reply = ("ok", handle(request))
        except Exception as error:
            reply = ("error", f"{type(error).__name__}: {error}")
        connection.send(reply)
