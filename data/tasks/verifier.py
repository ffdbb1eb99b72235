r"""The paper's reward: 1 if the last complete ``\boxed{}`` of a response is equivalent to the reference, else 0.

Equivalence is math-verify's, checked in a worker process's main thread (where its ``signal.alarm`` works) while
the caller waits with a hard deadline, since no alarm stops a long C-level computation (sympy expanding
``10^{10^{10}}``): a late worker is killed and scores 0, as does any error or crash on model output. Only a worker
that cannot start raises (scoring every response 0 would be worse). This module, which imports only the standard
library and ``answers``, is the worker: ``python -m lit_gmc.data.tasks.verifier --serve``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import subprocess
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from lit_gmc.data.tasks.answers import answer_region, last_boxed

WORKER_START_TIMEOUT_S = 120.0  # importing sympy can take a while on a loaded machine
_READY = "ready"


def _equivalent(reference: str, candidate: str, seconds: int) -> bool:
    """math-verify's verdict on two box contents (runs inside a worker)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    gold = parse(f"\\boxed{{{reference}}}", extraction_config=configs, parsing_timeout=seconds)
    if not gold:
        return False
    predicted = parse(f"\\boxed{{{candidate}}}", extraction_config=configs, parsing_timeout=seconds)
    return bool(predicted) and bool(verify(gold, predicted, timeout_seconds=seconds))


def serve(seconds: int, memory_limit_mb: int) -> None:
    """Worker loop: one JSON request per stdin line -> one JSON ``true``/``false`` per line on the protocol pipe."""
    import logging
    import resource

    if memory_limit_mb > 0:
        limit = memory_limit_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # Keep the protocol pipe private: anything else that prints (sympy, C extensions) goes to stderr.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its per-timeout warnings are expected here
    import math_verify  # noqa: F401  (import before announcing readiness, so the deadline excludes it)

    channel.write(json.dumps(_READY) + "\n")
    for line in sys.stdin:
        try:
            request = json.loads(line)
            verdict = _equivalent(request["reference"], request["candidate"], seconds)
        except Exception:  # noqa: BLE001 - any failure on model output (MemoryError too) is "not equivalent"
            verdict = False
        channel.write(json.dumps(verdict) + "\n")


def worker_command(seconds: int, memory_limit_mb: int) -> list[str]:
    """Command line of one worker: this module in a fresh interpreter (no fork of a process full of threads)."""
    return [sys.executable, "-m", "lit_gmc.data.tasks.verifier", "--serve", str(seconds), str(memory_limit_mb)]


class _Worker:
    """One verifier process, used by one thread at a time (the pool hands it out)."""

    def __init__(self, timeout_s: float, memory_limit_mb: int) -> None:
        self.timeout_s = timeout_s
        self.memory_limit_mb = memory_limit_mb
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        seconds = max(1, int(self.timeout_s // 4))  # parse, parse, verify: 3 alarms inside the hard deadline
        command = worker_command(seconds, self.memory_limit_mb)
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        _, reply = self._read(WORKER_START_TIMEOUT_S)
        if reply != _READY:
            self.stop()
            raise RuntimeError(
                f"the math-verify worker did not start ({' '.join(command)} answered {reply!r}); "
                "is math-verify installed in this environment?"
            )

    def _read(self, timeout: float) -> tuple[str, object]:
        """The next reply as ``(outcome, reply)``, outcome ``"ok"``, ``"timeout"`` (silent too long) or ``"crash"``."""
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            return "timeout", None
        line = self.process.stdout.readline()
        try:
            return ("ok", json.loads(line)) if line else ("crash", None)
        except ValueError:  # not our protocol: treat the worker as broken
            return "crash", line

    def check(self, reference: str, candidate: str) -> tuple[bool, str]:
        """``(equivalent, outcome)`` with outcome ``"ok"``, ``"timeout"`` or ``"crash"``."""
        if self.process is None or self.process.poll() is not None:
            self.start()
        try:
            self.process.stdin.write(json.dumps({"reference": reference, "candidate": candidate}) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            self.stop()
            return False, "crash"
        outcome, reply = self._read(self.timeout_s)
        if outcome != "ok":
            self.stop()  # a stuck worker may be deep inside sympy: only a kill is sure to stop it
        return reply is True, outcome

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            for pipe in (self.process.stdin, self.process.stdout):
                with contextlib.suppress(OSError):  # closing a pipe to a killed process may fail to flush
                    pipe.close()
            self.process = None


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop()


class MathVerifier:
    """Thread-safe, time-bounded math-verify rewards over a small pool of worker processes.

    Workers start on first use. Counts of checks, timeouts and crashes are kept in ``stats``.

    Args:
        num_workers: Worker processes (checks of one call are spread over them).
        timeout_s: Hard wall-clock bound on one check; past it the worker is killed and the check scores 0.
        memory_limit_mb: Address-space cap of each worker (0: none), so a runaway expansion fails fast.
        max_answer_chars: Box contents longer than this score 0 without being parsed (no real answer is).
        cut_at_next_problem: Score only :func:`~lit_gmc.data.tasks.answers.answer_region` (the paper scores the
            whole completion).
    """

    def __init__(
        self, num_workers: int = 2, timeout_s: float = 10.0, memory_limit_mb: int = 4096, max_answer_chars: int = 1000,
        cut_at_next_problem: bool = False,
    ) -> None:  # fmt: skip
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.memory_limit_mb = memory_limit_mb
        self.max_answer_chars = max_answer_chars
        self.cut_at_next_problem = cut_at_next_problem
        self._setup()

    def _setup(self) -> None:
        self._workers = [_Worker(self.timeout_s, self.memory_limit_mb) for _ in range(self.num_workers)]
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for worker in self._workers:
            self._idle.put(worker)
        self._stats_lock = threading.Lock()
        self.stats: Counter[str] = Counter()
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def __getstate__(self) -> dict:
        options = ("num_workers", "timeout_s", "memory_limit_mb", "max_answer_chars", "cut_at_next_problem")
        return {k: getattr(self, k) for k in options}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._setup()

    def _run(self, jobs: list[tuple[int, str, str]], out: list[float]) -> None:
        worker = self._idle.get()
        try:
            for index, reference, candidate in jobs:
                equivalent, outcome = worker.check(reference, candidate)
                out[index] = float(equivalent)
                with self._stats_lock:
                    self.stats[outcome] += 1
        finally:
            self._idle.put(worker)

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """Rewards of ``(response, reference)`` pairs, in order: 1.0 if the response's last box is equivalent."""
        out = [0.0] * len(pairs)
        jobs = []
        for index, (response, reference) in enumerate(pairs):
            if self.cut_at_next_problem and isinstance(response, str):
                response = answer_region(response)
            answer = last_boxed(response) if isinstance(response, str) else None
            if answer and len(answer) <= self.max_answer_chars and isinstance(reference, str):
                jobs.append((index, reference, answer))
        shares = [jobs[k :: self.num_workers] for k in range(self.num_workers) if jobs[k :: self.num_workers]]
        if shares:
            with ThreadPoolExecutor(len(shares)) as pool:
                list(pool.map(lambda share: self._run(share, out), shares))
        return out

    def score(self, responses: Sequence[str], reference: str) -> list[float]:
        """Rewards of several responses to one problem."""
        return self.score_pairs([(response, reference) for response in responses])

    def close(self) -> None:
        """Stop the worker processes (they restart if the verifier is used again)."""
        _stop_all(self._workers)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--serve":
        sys.exit("usage: python -m lit_gmc.data.tasks.verifier --serve SECONDS MEMORY_LIMIT_MB")
    serve(int(sys.argv[2]), int(sys.argv[3]))
