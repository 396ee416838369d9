"""Benchmarks: decoding throughput against peers (``bench.decode``) and server load (``bench.load``).

``model`` is imported first so that its process settings (MKL's buffer pool off,
model/engine/allocator.py) are in place before a benchmark imports torch."""

import model  # noqa: F401
