"""The HTTP service: ``http`` (routes, request parsing, errors), ``serving`` (the translate use
case, scheduler, model thread), ``formats`` (segmentation, markup, documents), ``storage``
(files, suggestions, rate limits), ``observability`` (metrics, timing, traces, logs).

``model`` is imported first so that its process settings (MKL's buffer pool off,
``model.engine.allocator``) are in place before anything here imports torch.
"""

from importlib import metadata

import model  # noqa: F401

DISTRIBUTION = "transformer-translator"


def version() -> str:
    """The installed package's version (from its metadata)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # running from a checkout that was never installed
        return "0+unknown"
