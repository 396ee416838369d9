"""``bench.threads``: finding a local server by its port and splitting its threads' time."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time

import pytest

from bench import threads

pytestmark = pytest.mark.skipif(
    threads.sample(os.getpid()) is None, reason="needs Linux's /proc with schedstat (the kernel's CONFIG_SCHED_INFO)"
)


def test_the_process_listening_on_a_port_is_found() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        assert threads.listening_pid(port) is None  # bound, not listening yet
        server.listen()
        assert threads.listening_pid(port) == os.getpid()


def test_a_busy_thread_runs_and_a_waiting_one_sleeps() -> None:
    """A thread busy on a CPU for the window shows as running (or waiting for a CPU) most of
    it; one blocked on an event as asleep; the main thread is the event loop's row."""
    stop, release = threading.Event(), threading.Event()
    block = bytes(1 << 20)

    def spin() -> None:  # hashing releases Python's lock: the thread keeps a CPU, not the lock
        while not stop.is_set():
            hashlib.sha256(block).digest()

    spinning = threading.Thread(target=spin)
    waiting = threading.Thread(target=release.wait)
    spinning.start()
    waiting.start()
    try:
        pid = os.getpid()
        time.sleep(0.05)  # (both threads settled: the one blocked, the other hashing)
        before = threads.sample(pid)
        time.sleep(0.5)
        after = threads.sample(pid)
    finally:
        stop.set()
        release.set()
        spinning.join()
        waiting.join()
    assert before is not None and after is not None
    rows = {row.thread: row for row in threads.shares(pid, before, after, requests=10, least=0.0)}
    assert rows["event loop"].sleep > 0.5  # the main thread slept through the window
    busy = next(row for label, row in rows.items() if label.endswith(f" {spinning.native_id}"))
    wait = next(row for label, row in rows.items() if label.endswith(f" {waiting.native_id}"))
    assert busy.run + busy.runqueue > 0.7  # on a CPU, or waiting for one on a busy machine
    wall = after.ended - before.started
    assert busy.cpu_ms_per_request == pytest.approx(1000 * busy.run * wall / 10, abs=0.5)
    assert wait.run < 0.05 and wait.sleep > 0.8
    assert all(0 <= r.run <= 1.05 and 0 <= r.runqueue <= 1.05 and 0 <= r.sleep <= 1 for r in rows.values()), rows


def test_model_threads_are_told_apart_by_their_start_order() -> None:
    """The first started "model" thread is the model thread; later ones are the OpenMP workers it
    started (by start time, not id: ids wrap)."""
    before_threads = {
        10: threads.ThreadSample("python", 0, 0, 100),
        32000: threads.ThreadSample("model", 0, 0, 200),
        13: threads.ThreadSample("model", 0, 0, 900),  # started later, with an id that wrapped
        11: threads.ThreadSample("libuv-worker", 0, 0, 150),
        12: threads.ThreadSample("python", 0, 0, 160),
    }
    after_threads = {
        10: threads.ThreadSample("python", 100_000_000, 50_000_000, 100),
        32000: threads.ThreadSample("model", 800_000_000, 150_000_000, 200),
        13: threads.ThreadSample("model", 900_000_000, 50_000_000, 900),
        11: threads.ThreadSample("libuv-worker", 0, 0, 150),  # idle: left out
        12: threads.ThreadSample("python", 0, 900_000_000, 160),  # never ran, waited: kept
        14: threads.ThreadSample("model", 10, 0, 950),  # started during the run: no share
    }
    before = threads.Snapshot(5.0, 5.01, before_threads)
    after = threads.Snapshot(5.99, 6.0, after_threads)  # 1 s from the first reading to the last
    rows = threads.shares(10, before, after, requests=100)
    assert [(r.thread, r.run, r.runqueue, r.sleep, r.cpu_ms_per_request) for r in rows] == [
        ("event loop", 0.1, 0.05, 0.85, 1.0),
        ("model's OpenMP worker 1", 0.9, 0.05, 0.05, 9.0),
        ("model", 0.8, 0.15, 0.05, 8.0),
        ("python 12", 0.0, 0.9, 0.1, 0.0),
    ]


def test_shares_stay_within_the_window() -> None:
    """The kernel counts a wait when it ends, so a wait begun before the window can exceed it:
    each share is held to the window, and the rest is never negative."""
    before = threads.Snapshot(0.0, 0.0, {1: threads.ThreadSample("python", 0, 0, 1)})
    after = threads.Snapshot(1.0, 1.0, {1: threads.ThreadSample("python", 600_000_000, 700_000_000, 1)})
    (row,) = threads.shares(1, before, after, requests=1)
    assert (row.run, row.runqueue, row.sleep) == (0.6, 0.4, 0.0)
