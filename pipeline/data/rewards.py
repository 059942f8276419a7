"""Verifiable math rewards: score completions against gold answers with math-verify, under a deadline.

What: ``score_batch`` extracts each completion's final answer (``qerl.pipeline.data.answers``),
verifies it against the normalised gold answer in a pool of worker processes (``VerifierPool``) and
returns one ``ScoreRecord`` per completion, in input order. Reward = ``correct_reward * correct +
format_reward * format_ok``.

How the pool departs from the usual ``math_verify.verify`` loop, and why:

* math-verify's own timeouts use ``signal.alarm``: they fail off the main thread (Prefect runs tasks
  in threads) and cannot interrupt a long computation inside C code. Workers therefore run
  math-verify with its timeouts disabled (``parsing_timeout=None``, ``timeout_seconds=None``) and the
  parent enforces a wall-clock deadline per answer: a worker still busy at the deadline is killed
  (SIGKILL), the answer scores 0 with status ``timeout``, a fresh worker takes its place and the rest
  of its chunk is re-queued. A worker that dies (segfault, GMP abort on out-of-memory) is replaced the
  same way and its current answer gets status ``error``. Workers also run under an address-space limit
  so a power tower cannot eat the machine's memory before its deadline.
* Workers come from a ``forkserver`` context with math-verify preloaded and warmed up
  (``qerl.pipeline.data._reward_warmup``), so replacing a killed worker costs a fork (milliseconds), not a
  fresh interpreter importing sympy and building parsers. The forkserver also makes the pool safe to
  start from any thread.
* Identical (prediction, gold) pairs are verified once per batch: verification is a deterministic
  function of the two normalised strings, so this changes no result, and it makes a repeated
  pathological answer cost one deadline instead of one per sample.
* Fast path (``RewardConfig.fast_path``, on by default): a pair of canonical integers is decided
  without a worker (``qerl.pipeline.data.answers.fast_verdict``, provably math-verify's verdict).

Caveat of a wall-clock deadline: on a heavily overloaded machine an ordinary answer can miss it. It
then scores 0 with status ``timeout``, counted in the stage metrics, never silently; raise
``timeout_s`` on such machines.

Results and resources (``qerl.pipeline.config``): the pool's size, chunking, memory limit, start-up
deadline and the fast path change how fast verdicts come, not which; the per-answer deadline is a
resource field too, although a missed deadline is a verdict (``timeout``, reward 0): which answers
miss it depends on the machine's load as much as on ``timeout_s``, which no key can hold, and the
advice above (raise it on a loaded machine) must not cost a resumed run its finished steps. Every
``timeout`` is counted in the stage's metrics and the manifest records the deadline.

Gold answers are parsed as LaTeX (wrapped in ``$...$``, ``LatexExtractionConfig`` only); predictions
as LaTeX or plain expressions. Model output is never evaluated as Python.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from multiprocessing.connection import wait as mp_wait
from typing import Any, Literal

from pydantic import Field
from qerl.pipeline.config import StrictModel, resource_field
from qerl.pipeline.data.answers import AnswerFormat, extract_with_format, fast_verdict, normalize_answer

log = logging.getLogger("qerl.rewards")

Status = Literal["ok", "no_answer", "timeout", "error"]
STATUSES: tuple[str, ...] = ("ok", "no_answer", "timeout", "error")


class RewardConfig(StrictModel):
    """How completions are scored (the ``score`` stage's config)."""

    answer_format: AnswerFormat = "auto"
    correct_reward: float = 1.0
    format_reward: float = Field(0.0, description="added when the answer is in the requested format")
    timeout_s: float = resource_field(5.0, gt=0, description="wall-clock deadline per answer")
    workers: int = resource_field(
        4, ge=1, description="verifier processes; deadline waits need no CPU, so more than cores"
    )
    chunk_size: int = resource_field(8, ge=1, description="answers sent to a worker at a time")
    worker_memory_mb: int = resource_field(3072, ge=256, description="address-space limit of a worker")
    startup_timeout_s: float = resource_field(120.0, gt=0)
    fast_path: bool = resource_field(
        True, description="integer pairs decided without a worker (same verdict)"
    )


@dataclass(frozen=True)
class ScoreRecord:
    """One completion's score. ``status``: ok / no_answer / timeout / error."""

    correct: bool
    reward: float
    extracted: str | None
    status: Status
    format_ok: bool = False
    detail: str | None = None
    latency_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------------
# worker side (runs in the pool's processes)


@lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> Any:
    from math_verify import LatexExtractionConfig, parse

    return parse(f"${gold}$", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)


def verify_pair(pred: str, gold: str) -> tuple[Status, bool, str | None]:
    """math-verify on one normalised pair, with its signal timeouts off: run only under a deadline."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold_parsed = _parse_gold(gold)
    if all(isinstance(x, str) for x in gold_parsed):  # only the raw-string fallback: LaTeX did not parse
        return "error", False, f"gold answer {gold[:80]!r} does not parse as LaTeX"
    pred_parsed = parse(
        f"${pred}$", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None
    )
    if not pred_parsed:
        return "ok", False, "prediction does not parse"
    return "ok", bool(verify(gold_parsed, pred_parsed, timeout_seconds=None)), None


def _worker_main(conn: Any, memory_mb: int) -> None:
    import resource

    with contextlib.suppress(ValueError, OSError):
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" warnings: by design
    conn.send(("ready", os.getpid()))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for idx, pred, gold in chunk:
            try:
                status, correct, detail = verify_pair(pred, gold)
            except MemoryError:
                status, correct, detail = "error", False, f"MemoryError (limit {memory_mb} MiB)"
            except BaseException as err:  # noqa: BLE001 - never str() a sympy error: it can hang
                status, correct, detail = "error", False, type(err).__name__
            conn.send((idx, status, correct, detail))


# --------------------------------------------------------------------------------------------------
# the pool (parent side)


@dataclass
class _Worker:
    proc: Any
    conn: Any
    ready: bool = False
    started_at: float = 0.0  # when it was launched (startup deadline)
    busy: collections.deque | None = None  # items sent and not answered, current first
    item_since: float = 0.0  # when the current item began (parent's view)


class VerifierPool:
    """Worker processes verifying (prediction, gold) pairs under a per-answer deadline.

    Use as a context manager or call ``close()``. ``verify_many`` is not re-entrant: one batch at a time.
    """

    def __init__(self, cfg: RewardConfig | None = None):
        self.cfg = cfg or RewardConfig()
        self._ctx = multiprocessing.get_context("forkserver")
        # Preload math-verify (sympy, antlr) in the fork server once; every worker is then a cheap fork.
        self._ctx.set_forkserver_preload(
            ["math_verify", "qerl.pipeline.data.rewards", "qerl.pipeline.data._reward_warmup"]
        )
        self.restarts = 0
        self._dying: list[Any] = []
        self._workers: list[_Worker] = [self._launch() for _ in range(self.cfg.workers)]

    def _launch(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main, args=(child, self.cfg.worker_memory_mb), daemon=True, name="qerl-verifier"
        )
        proc.start()
        child.close()
        return _Worker(proc=proc, conn=parent, started_at=time.monotonic(), busy=collections.deque())

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def _replace(self, i: int) -> None:
        old = self._workers[i]
        if old.proc.is_alive():
            old.proc.kill()
        old.conn.close()
        # Reaped later: the kernel can take seconds to free a killed worker's gigabytes, and waiting
        # here would delay the other workers' deadline checks.
        self._dying.append(old.proc)
        self._dying = [p for p in self._dying if p.is_alive()]
        self.restarts += 1
        self._workers[i] = self._launch()

    def close(self) -> None:
        for w in self._workers:
            with contextlib.suppress(OSError, ValueError):
                w.conn.send(None)
        for w in self._workers:
            w.proc.join(1)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(1)
            w.conn.close()
        for proc in self._dying:
            proc.join(5)
        self._workers, self._dying = [], []

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def verify_many(
        self, pairs: Sequence[tuple[str, str]], progress: Callable[[int], None] | None = None
    ) -> list[tuple[Status, bool, str | None, float]]:
        """(status, correct, detail, latency_s) per pair, in order; no pair costs more than the deadline."""
        results: list[tuple[Status, bool, str | None, float] | None] = [None] * len(pairs)
        pending = collections.deque(range(len(pairs)))
        deadline = self.cfg.timeout_s

        def finish(idx: int, status: Status, correct: bool, detail: str | None, since: float) -> None:
            results[idx] = (status, correct, detail, time.monotonic() - since)
            if progress is not None:
                progress(1)

        while pending or any(w.busy for w in self._workers):
            now = time.monotonic()
            for w in self._workers:
                if w.ready and not w.busy and pending:
                    # small batches are split evenly so no worker idles while another holds a queue
                    size = min(self.cfg.chunk_size, -(-len(pending) // len(self._workers)))
                    chunk = [pending.popleft() for _ in range(size)]
                    w.busy.extend(chunk)
                    w.conn.send([(i, *pairs[i]) for i in chunk])
                    w.item_since = now
            waits = [w.item_since + deadline - now for w in self._workers if w.busy]
            waits += [w.started_at + self.cfg.startup_timeout_s - now for w in self._workers if not w.ready]
            timeout = max(0.0, min(waits)) if waits else None
            mp_wait([w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers], timeout)
            for i, w in enumerate(self._workers):
                dead = False
                try:
                    while w.conn.poll():
                        msg = w.conn.recv()
                        if msg[0] == "ready":
                            w.ready = True
                            continue
                        idx, status, correct, detail = msg
                        if w.busy and w.busy[0] == idx:
                            w.busy.popleft()
                            finish(idx, status, correct, detail, w.item_since)
                            w.item_since = time.monotonic()
                except (EOFError, OSError):
                    dead = True
                dead = dead or not w.proc.is_alive()
                now = time.monotonic()
                if dead:
                    code = w.proc.exitcode
                    if w.busy:
                        finish(
                            w.busy.popleft(),
                            "error",
                            False,
                            f"verifier worker died (exit code {code})",
                            w.item_since,
                        )
                    elif not w.ready:
                        raise RuntimeError(f"verifier worker failed to start (exit code {code})")
                    pending.extendleft(reversed(w.busy))
                    log.warning("verifier worker %s died (exit code %s): replaced", w.proc.pid, code)
                    self._replace(i)
                elif w.busy and now - w.item_since >= deadline:
                    finish(
                        w.busy.popleft(), "timeout", False, f"no verdict within {deadline:g} s", w.item_since
                    )
                    pending.extendleft(reversed(w.busy))
                    log.info(
                        "verifier worker %s passed the %g s deadline: killed and replaced",
                        w.proc.pid,
                        deadline,
                    )
                    self._replace(i)
                elif not w.ready and now - w.started_at >= self.cfg.startup_timeout_s:
                    raise RuntimeError(
                        f"verifier worker did not start within {self.cfg.startup_timeout_s:g} s"
                    )
        return results  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------------
# the public scorer


def score_batch(
    completions: Sequence[str],
    answers: Sequence[str],
    cfg: RewardConfig | None = None,
    pool: VerifierPool | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[ScoreRecord]:
    """Score each completion against its gold answer; one record per completion, in input order.

    ``pool`` reuses a running ``VerifierPool`` (else one is started and closed here). ``progress(n)``
    is called as answers finish.
    """
    cfg = cfg or RewardConfig()
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} gold answers")
    extracted: list[tuple[str | None, str | None]] = []
    for i, text in enumerate(completions):
        if not isinstance(text, str):
            raise TypeError(f"completion {i} is {type(text).__name__}, not str")
        extracted.append(extract_with_format(text, cfg.answer_format))
    golds = []
    for i, gold in enumerate(answers):
        if gold is None or not str(gold).strip():
            raise ValueError(f"gold answer {i} is empty")
        golds.append(normalize_answer(str(gold)))

    verdicts: dict[tuple[str, str], tuple[Status, bool, str | None, float]] = {}
    todo: list[tuple[str, str]] = []
    for (pred, _), gold in zip(extracted, golds, strict=True):
        if pred is None or (pred, gold) in verdicts:
            continue
        fast = fast_verdict(pred, gold) if cfg.fast_path else None
        if fast is not None:
            verdicts[(pred, gold)] = ("ok", fast, None, 0.0)
        else:
            verdicts[(pred, gold)] = ("ok", False, None, 0.0)  # placeholder, filled below
            todo.append((pred, gold))
    if progress is not None:
        progress(len(completions) - len(todo))
    if todo:
        own = pool is None
        pool = pool or VerifierPool(cfg)
        try:
            for pair, verdict in zip(todo, pool.verify_many(todo, progress), strict=True):
                verdicts[pair] = verdict
        finally:
            if own:
                pool.close()

    records = []
    for (pred, fmt), gold in zip(extracted, golds, strict=True):
        format_ok = fmt is not None and (fmt != "last_number" or cfg.answer_format == "last_number")
        bonus = cfg.format_reward if format_ok else 0.0
        if pred is None:
            records.append(ScoreRecord(False, bonus, None, "no_answer", format_ok))
            continue
        status, correct, detail, latency = verdicts[(pred, gold)]
        reward = (cfg.correct_reward if correct else 0.0) + bonus
        records.append(ScoreRecord(correct, reward, pred, status, format_ok, detail, latency))
    return records
