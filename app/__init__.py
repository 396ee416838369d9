"""The HTTP service. ``model`` is imported first so that its process settings (MKL's buffer pool
off, model/allocator.py) are in place before anything here imports torch."""

import model  # noqa: F401
