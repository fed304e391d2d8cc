"""The `math_verify` reward: symbolic equivalence via Hugging Face's math-verify library, bounded in time from any
thread (math-verify's `signal.alarm` bound works only in a main thread): it runs in child processes, each bounding a
request with its own alarm, and a child that does not answer in time is killed."""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .text import pair_up

logger = logging.getLogger(__name__)

_WORKER_SCRIPT = Path(__file__).with_name("_math_verify_worker.py")
_STARTUP_TIMEOUT_S = 120.0


class MathVerifyError(RuntimeError):
    """math-verify raised on an input, and the reward was built with `on_error="raise"`."""


@dataclass(frozen=True)
class Verdict:
    """What math-verify concluded for one completion: `verdict` is "correct", "incorrect", "no_answer",
    "gold_unparsable", "gold_missing", "timeout" or "error"; `stage` ("gold", "prediction", "verify", or "worker" when
    the child process was killed) says where."""

    verdict: str
    stage: str | None = None
    parsed: str | None = None
    detail: str | None = None


_EXITED = Verdict("error", "worker", detail="the math-verify worker exited unexpectedly")


class _VerifierProcess:
    """One math-verify child process, used by one thread at a time."""

    def __init__(self) -> None:
        self._start()

    def _start(self) -> None:
        command = [sys.executable, "-u", str(_WORKER_SCRIPT)]
        self._process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        self._buffer = b""
        hello = self._read_line(_STARTUP_TIMEOUT_S)
        if hello is None:
            self.kill()
            raise RuntimeError(
                f"The math-verify worker did not start within {_STARTUP_TIMEOUT_S:.0f} s ({sys.executable} {_WORKER_SCRIPT})."
            )
        message = json.loads(hello)
        if not message.get("ready"):
            self.kill()
            raise ImportError(
                f"The math_verify reward needs the math-verify package, which failed to import: {message.get('error')}. "
                "Install it with `pip install 'math-verify>=0.9,<0.10'`."
            )

    def kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._process.stdin.close()
        self._process.stdout.close()

    def _read_line(self, timeout: float) -> bytes | None:
        deadline = time.monotonic() + timeout
        stdout = self._process.stdout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([stdout], [], [], remaining)[0]:
                return None
            chunk = os.read(stdout.fileno(), 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def judge(self, gold: str, prediction: str, timeout: float, grace: float) -> Verdict:
        """Verdict for one pair; restarts the child first if an earlier request had to kill it."""
        if self._process.poll() is not None:
            self._start()
        request = json.dumps({"gold": gold, "prediction": prediction, "timeout": timeout}).encode() + b"\n"
        try:
            self._process.stdin.write(request)
            self._process.stdin.flush()
        except (BrokenPipeError, OSError):
            self.kill()
            return _EXITED
        line = self._read_line(timeout + grace)
        if line is None:
            alive = self._process.poll() is None
            self.kill()
            return Verdict("timeout", "worker") if alive else _EXITED
        return Verdict(**json.loads(line))


class _WorkerPool:
    """Child processes shared by every math_verify reward in this process, at most one per concurrent caller."""

    def __init__(self, max_workers: int) -> None:
        self.pid = os.getpid()
        self._idle: list[_VerifierProcess] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_workers)
        self._workers: list[_VerifierProcess] = []

    @contextmanager
    def lease(self):
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None:
                worker = _VerifierProcess()
                with self._lock:
                    self._workers.append(worker)
            try:
                yield worker
            finally:
                with self._lock:
                    self._idle.append(worker)

    def close(self) -> None:
        with self._lock:
            workers, self._workers, self._idle = self._workers, [], []
        for worker in workers:
            worker.kill()


_pool: _WorkerPool | None = None
_pool_lock = threading.Lock()


def _shared_pool() -> _WorkerPool:
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():
            _pool = _WorkerPool(max_workers=min(8, os.cpu_count() or 1))
        return _pool


@atexit.register
def _close_shared_pool() -> None:
    if _pool is not None and _pool.pid == os.getpid():
        _pool.close()


_SCORES = {"correct": 1.0, "incorrect": 0.0, "no_answer": 0.0}


class MathVerifyReward:
    """1.0 when math-verify finds the completion's answer equivalent to the gold answer (wrapped in `\\boxed{}` unless
    it has `$` or `\\boxed`, so that `2^{1009}` is read whole), 0.0 when not, when the completion has no answer or
    takes longer than `timeout_seconds`; None (left out by TRL) for a missing or unparsable gold answer, and with a
    warning where math-verify raises on the completion (`MathVerifyError` with `on_error="raise"`). Logs
    `math_verify/timeout_fraction` and `math_verify/error_fraction`, and `math_verify_reward/extracted` to the
    completions table."""

    def __init__(self, timeout_seconds: float = 5.0, *, on_error: Literal["skip", "raise"] = "skip") -> None:
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds}.")
        if on_error not in ("skip", "raise"):
            raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}.")
        self.timeout_seconds = float(timeout_seconds)
        self.on_error = on_error
        self.__name__ = "math_verify_reward"

    def __repr__(self) -> str:
        return f"MathVerifyReward(timeout_seconds={self.timeout_seconds}, on_error={self.on_error!r})"

    @property
    def hard_timeout_seconds(self) -> float:
        """Longest wait for one completion before its child process is killed: the bound plus a grace period."""
        return self.timeout_seconds + max(2.0, self.timeout_seconds)

    def judge(self, completions: Sequence[Any], solution: Sequence[Any] | None) -> list[Verdict]:
        """The verdict for each completion, without turning it into a score."""
        texts, golds = pair_up(completions, solution, self.__name__)
        grace = self.hard_timeout_seconds - self.timeout_seconds
        with _shared_pool().lease() as worker:
            return [
                Verdict("gold_missing", "gold")
                if gold is None
                else worker.judge(gold, text, self.timeout_seconds, grace)
                for text, gold in zip(texts, golds, strict=True)
            ]

    def __call__(self, completions, solution=None, log_extra=None, log_metric=None, **kwargs) -> list[float | None]:
        verdicts = self.judge(completions, solution)
        for index, verdict in enumerate(verdicts):
            if verdict.verdict == "error" and verdict.stage != "gold" and self.on_error == "raise":
                raise MathVerifyError(
                    f"math-verify failed on completion {index} at stage {verdict.stage}: {verdict.detail}"
                )
        # A timeout scores 0.0 unless it was the gold answer's; an error, a missing or unparsable gold answer None.
        scores = [0.0 if v.verdict == "timeout" and v.stage != "gold" else _SCORES.get(v.verdict) for v in verdicts]
        counts, total = Counter(verdict.verdict for verdict in verdicts), len(verdicts)
        if counts["timeout"]:
            logger.warning(
                f"math_verify_reward: {counts['timeout']} of {total} completions hit the {self.timeout_seconds:.1f} s "
                "bound and scored 0.0 (or None for a gold answer)."
            )
        if errors := [v for v in verdicts if v.verdict == "error"]:
            logger.warning(
                f"math_verify_reward: math-verify raised on {len(errors)} of {total} completions; they score None. "
                f"First: stage {errors[0].stage}, {errors[0].detail}"
            )
        if gold_problems := counts["gold_unparsable"] + counts["gold_missing"]:
            logger.warning(
                f"math_verify_reward: {gold_problems} of {total} completions have a missing or unparsable gold answer "
                "and score None."
            )
        if log_metric is not None and verdicts:
            log_metric("math_verify/timeout_fraction", counts["timeout"] / total)
            log_metric("math_verify/error_fraction", counts["error"] / total)
        if log_extra is not None:
            log_extra(f"{self.__name__}/extracted", [verdict.parsed for verdict in verdicts])
        return scores


math_verify_reward = MathVerifyReward()  # the registered `math_verify` reward: a 5 s bound per completion
