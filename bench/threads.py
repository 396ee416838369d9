"""Where a server's threads spent a load run: on a CPU, waiting for one, or asleep (Linux).

``bench.load`` reads every thread of the server process before and after a run from
``/proc/<pid>/task/<tid>/schedstat`` (time on a CPU, time runnable but waiting for one) and
reports each thread's shares of the run's wall time. On a small machine that tells the costs
of serving apart: a model thread *waiting for a CPU* was preempted (by the event loop, say); a
model thread *asleep* while requests are queued waited for a lock (Python's, in one process).

The server is the one process that listens on the URL's port on this machine (ours, or
LibreTranslate behind ``--url``). There is no answer (None) for a remote server, where several
processes hold the port (a server with worker processes, a proxy in front), without ``/proc``,
or where the kernel keeps no schedstat. The shares are the kernel's accounting: a wait that
began before the run is counted when it ends, so a share can be off by a scheduler tick.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp
MODEL = "model"  # the OS name of our server's model thread (``app.serving.scheduler.ModelThread``)
WORKER = f"{MODEL}'s OpenMP worker"


@dataclass(frozen=True)
class ThreadSample:
    name: str  # the OS thread name (``comm``); ours names its model thread "model"
    run_ns: int  # on a CPU so far
    wait_ns: int  # runnable, waiting for a CPU, so far
    started: int  # when the thread started, in clock ticks after boot (/proc/.../stat field 22)


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
    """The one process that listens on this TCP port on this machine; None if none is visible
    or several hold the socket (a supervisor and its workers, a proxy)."""
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
    holders = {int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit() and _holds(entry, targets)}
    return holders.pop() if len(holders) == 1 else None


def _holds(process: Path, sockets: set[str]) -> bool:
    """Whether this /proc/<pid> has one of these sockets open (False where its fds are unreadable)."""
    try:
        fds = list((process / "fd").iterdir())
    except OSError:  # another user's process, or gone
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in sockets:
                return True
        except OSError:
            continue
    return False


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
            stat = (task / "stat").read_text()
            start = int(stat[stat.rindex(")") + 2 :].split()[19])  # field 22, after the name in parentheses
        except (OSError, ValueError):  # the thread ended, or the kernel keeps no schedstat
            continue
        out[int(task.name)] = ThreadSample(name, run, wait, start)
    if not out or all(s.run_ns == 0 for s in out.values()):  # (a kernel without sched_info reads zeros)
        return None
    return Snapshot(started, time.perf_counter(), out)


def shares(pid: int, before: Snapshot, after: Snapshot, requests: int, least: float = 0.01) -> list[ThreadShare]:
    """Each thread alive at both snapshots that ran or waited to run at least ``least`` of the
    wall time between them, busiest first (the main thread first: it runs the event loop). Of
    the threads named "model" (ours names its model thread so, and the OpenMP workers that thread
    starts inherit the name) the first started is the model thread itself."""
    wall_s = after.ended - before.started
    models = sorted((s.started, tid) for tid, s in after.threads.items() if s.name == MODEL)
    workers = {tid: n for n, (_, tid) in enumerate(models[1:], start=1)}
    rows = []
    for tid, end in after.threads.items():
        start = before.threads.get(tid)
        if start is None:
            continue
        run = min((end.run_ns - start.run_ns) / 1e9, wall_s)
        wait = min((end.wait_ns - start.wait_ns) / 1e9, wall_s - run)  # (see the module's docstring)
        if (run + wait) / wall_s < least:
            continue
        if tid == pid:
            label = "event loop"
        elif tid in workers:
            label = WORKER if len(workers) == 1 else f"{WORKER} {workers[tid]}"
        elif end.name == MODEL:
            label = MODEL
        else:
            label = f"{end.name} {tid}"
        rows.append(
            ThreadShare(
                label,
                round(run / wall_s, 3),
                round(wait / wall_s, 3),
                round(1 - (run + wait) / wall_s, 3),
                round(1000 * run / max(requests, 1), 3),
            )
        )
    return sorted(rows, key=lambda r: (r.thread != "event loop", -r.run))
