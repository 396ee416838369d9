"""Benchmarks: decoding throughput against peers (``bench.decode``) and server load (``bench.load``)."""
