"""Where a server's threads spent a load run: on a CPU, waiting for one, or asleep (Linux).

``bench.load`` reads every thread of the server process before and after a run from
``/proc/<pid>/task/<tid>/schedstat`` (time on a CPU, time runnable but waiting for one) and
reports each thread's shares of the run's wall time. On a small machine that tells the costs
of serving apart: a model thread *waiting for a CPU* was preempted (by the event loop, say); a
model thread *asleep* while requests are queued waited for a lock (Python's, in one process).

The server is found by the port it listens on, so this works for any local server (ours, or
LibreTranslate behind ``--url``), and says nothing (None) for a remote one, on a system without
``/proc``, or where the kernel keeps no schedstat.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp
MODEL = "model"  # the OS name of our server's model thread (``app.batching.ModelThread``)


@dataclass(frozen=True)
class ThreadSample:
    name: str  # the OS thread name (``comm``); ours names its model thread "model"
    run_ns: int  # on a CPU so far
    wait_ns: int  # runnable, waiting for a CPU, so far


@dataclass(frozen=True)
class Snapshot:
    started: float  # perf_counter() before the first thread was read
    ended: float  # and after the last: a window between two snapshots holds both readings
    threads: dict[int, ThreadSample]


@dataclass(frozen=True)
class ThreadShare:
    thread: str  # "event loop", "model", "model's OpenMP worker", or another thread's name and id
    run: float  # share of the run's wall time on a CPU
    runqueue: float  # runnable but waiting for a CPU (preempted, or not yet scheduled)
    sleep: float  # the rest: blocked on a lock, I/O, or idle
    cpu_ms_per_request: float


def listening_pid(port: int) -> int | None:
    """The process that listens on this TCP port on this machine, or None (none, or not visible)."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    if not inodes:
        return None
    targets = {f"socket:[{inode}]" for inode in inodes}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # another user's process, or gone
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in targets:
                    return int(entry.name)
            except OSError:
                continue
    return None


def sample(pid: int) -> Snapshot | None:
    """Every thread of ``pid`` now; None without schedstat (or no such process)."""
    started = time.perf_counter()
    out: dict[int, ThreadSample] = {}
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            run, wait, _ = (int(x) for x in (task / "schedstat").read_text().split())
            name = (task / "comm").read_text().strip()
        except (OSError, ValueError):  # the thread ended, or the kernel keeps no schedstat
            continue
        out[int(task.name)] = ThreadSample(name, run, wait)
    return Snapshot(started, time.perf_counter(), out) if out else None


def shares(pid: int, before: Snapshot, after: Snapshot, requests: int, least: float = 0.01) -> list[ThreadShare]:
    """Each thread alive at both snapshots that ran at least ``least`` of the wall time between
    them, busiest first (the main thread first: it runs the event loop). Of the threads named
    "model" (ours names its model thread so, and the OpenMP workers that thread starts inherit
    the name) the first started, the lowest id, is the model thread itself."""
    wall_s = after.ended - before.started
    models = sorted(tid for tid, s in after.threads.items() if s.name == MODEL)
    rows = []
    for tid, end in after.threads.items():
        start = before.threads.get(tid)
        if start is None:
            continue
        run = (end.run_ns - start.run_ns) / 1e9
        wait = (end.wait_ns - start.wait_ns) / 1e9
        if run / wall_s < least:
            continue
        if tid == pid:
            label = "event loop"
        elif end.name == MODEL:
            label = MODEL if tid == models[0] else f"{MODEL}'s OpenMP worker"
        else:
            label = f"{end.name} {tid}"
        rows.append(
            ThreadShare(
                label,
                round(run / wall_s, 3),
                round(wait / wall_s, 3),
                round(max(0.0, 1 - (run + wait) / wall_s), 3),
                round(1000 * run / max(requests, 1), 3),
            )
        )
    return sorted(rows, key=lambda r: (r.thread != "event loop", -r.run))
