"""cli.ThreadRunner: the loop's executor keeps its workers (a new thread's start() waits for
the scheduler inside the loop's step: docs/loop-steps.md), and a stuck task never blocks
another."""

from __future__ import annotations

import threading
import time

from qwen4090.commandline.cli import ThreadRunner


def test_a_finished_worker_takes_the_next_task_instead_of_a_new_thread() -> None:
    done = threading.Semaphore(0)
    runner = ThreadRunner(done.release)
    first = runner.submit(threading.get_ident)
    assert first.result(5)
    assert done.acquire(timeout=5)
    deadline = time.monotonic() + 5
    while runner._idle == 0 and time.monotonic() < deadline:  # the worker is back waiting
        time.sleep(0.01)
    before = threading.active_count()
    second = runner.submit(threading.get_ident)
    assert second.result(5) == first.result()
    assert threading.active_count() == before


def test_a_stuck_task_does_not_hold_the_next_one_and_errors_reach_the_future() -> None:
    runner = ThreadRunner(lambda: None)
    release = threading.Event()
    stuck = runner.submit(release.wait, 10)
    quick = runner.submit(lambda x: x * 2, 21)
    assert quick.result(5) == 42 and not stuck.done()
    failing = runner.submit(lambda: 1 / 0)
    assert isinstance(failing.exception(5), ZeroDivisionError)
    release.set()
    assert stuck.result(5) is True


def test_many_tasks_at_once_all_run() -> None:
    runner = ThreadRunner(lambda: None)
    gate = threading.Barrier(8)
    futures = [runner.submit(gate.wait, 10) for _ in range(8)]  # all 8 must run together
    assert sorted(f.result(15) for f in futures) == list(range(8))
