r"""The paper's reward: 1 if the last complete ``\boxed{}`` of a response is equivalent to the reference, else 0.

Equivalence is math-verify's, checked in a worker process's main thread (where its ``signal.alarm`` works) under a
hard deadline, since no alarm stops a long C-level computation (sympy expanding ``10^{10^{10}}``): a late worker is
killed and scores 0, as does any error on model output; only workers that cannot start raise. pebble's
``ProcessPool`` kills and replaces a late worker (``concurrent.futures`` can only wait); its workers are spawned.
"""

from __future__ import annotations

import multiprocessing
import threading
import weakref
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import TimeoutError

from lit_gmc.data.tasks.answers import answer_region, last_boxed


def _equivalent(reference: str, candidate: str, seconds: int) -> bool:
    """math-verify's verdict on two box contents (runs inside a worker)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    gold = parse(f"\\boxed{{{reference}}}", extraction_config=configs, parsing_timeout=seconds)
    if not gold:
        return False
    predicted = parse(f"\\boxed{{{candidate}}}", extraction_config=configs, parsing_timeout=seconds)
    return bool(predicted) and bool(verify(gold, predicted, timeout_seconds=seconds))


def _check(reference: str, candidate: str, seconds: int) -> bool:
    """A worker's task: any failure on model output (MemoryError too) is "not equivalent"."""
    try:
        return _equivalent(reference, candidate, seconds)
    except Exception:  # noqa: BLE001
        return False


def _start_worker(memory_limit_mb: int) -> None:
    """A worker's initializer: its address-space cap, math-verify quiet and imported before any deadline runs."""
    import logging
    import resource

    if memory_limit_mb > 0:
        limit = memory_limit_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its per-timeout warnings are expected here
    import math_verify  # noqa: F401


class MathVerifier:
    """Thread-safe, time-bounded math-verify rewards over a small pool of worker processes.

    Workers start on first use. Counts of checks (``ok``), timeouts and crashes are kept in ``stats``.

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
        self.pool = None  # pebble's ProcessPool, started by the first check
        self._lock = threading.Lock()
        self.stats: Counter[str] = Counter()

    def __getstate__(self) -> dict:
        options = ("num_workers", "timeout_s", "memory_limit_mb", "max_answer_chars", "cut_at_next_problem")
        return {k: getattr(self, k) for k in options}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._setup()

    def _pool(self):
        with self._lock:
            if self.pool is None:
                from pebble import ProcessPool

                self.pool = ProcessPool(self.num_workers, initializer=_start_worker, initargs=(self.memory_limit_mb,),
                                        context=multiprocessing.get_context("spawn"))  # fmt: skip
                weakref.finalize(self, self.pool.stop)
            return self.pool

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """Rewards of ``(response, reference)`` pairs, in order: 1.0 if the response's last box is equivalent."""
        from concurrent.futures.process import BrokenProcessPool

        from pebble import ProcessExpired

        seconds = max(1, int(self.timeout_s // 4))  # parse, parse, verify: 3 alarms inside the hard deadline
        out, checks = [0.0] * len(pairs), {}
        for index, (response, reference) in enumerate(pairs):
            if self.cut_at_next_problem and isinstance(response, str):
                response = answer_region(response)
            answer = last_boxed(response) if isinstance(response, str) else None
            if answer and len(answer) <= self.max_answer_chars and isinstance(reference, str):
                checks[index] = self._pool().schedule(_check, (reference, answer, seconds), timeout=self.timeout_s)
        for index, check in checks.items():
            try:
                out[index], outcome = float(check.result()), "ok"
            except TimeoutError:  # the worker was killed, and is replaced
                outcome = "timeout"
            except ProcessExpired:
                outcome = "crash"
            except BrokenProcessPool as err:  # every worker died in its initializer
                self.close()
                raise RuntimeError("the math-verify workers did not start; is math-verify installed in this "
                                   "environment?") from err  # fmt: skip
            with self._lock:
                self.stats[outcome] += 1
        return out

    def score(self, responses: Sequence[str], reference: str) -> list[float]:
        """Rewards of several responses to one problem."""
        return self.score_pairs([(response, reference) for response in responses])

    def close(self) -> None:
        """Stop the worker processes (they restart if the verifier is used again)."""
        with self._lock:
            pool, self.pool = self.pool, None
        if pool is not None:
            pool.stop()
            pool.join()
