"""Translated files (``POST /translate_file``) kept in memory until they are fetched
(``GET /download_file/{name}``) or expire: the pods' root filesystem is read-only, and no
name a client sends ever reaches a filesystem. Names are random and unguessable
(``secrets.token_urlsafe``): knowing one is what entitles a client to the file.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredFile:
    filename: str
    media_type: str
    data: bytes
    expires: float  # the store's clock


class FileStore:
    """Translated files in memory, at most ``max_files`` of them and ``max_bytes`` together
    (the oldest go first), each for ``ttl_s`` seconds. Used from the event loop only."""

    def __init__(
        self, max_files: int, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_files, self.max_bytes, self.ttl_s, self.clock = max_files, max_bytes, ttl_s, clock
        self._files: OrderedDict[str, StoredFile] = OrderedDict()  # oldest first: expiry order too
        self._bytes = 0

    def put(self, filename: str, media_type: str, data: bytes, suffix: str) -> str:
        """Keep a file (ValueError if it alone is over ``max_bytes``); its new name (random,
        unguessable, ending in ``suffix``)."""
        if len(data) > self.max_bytes:
            raise ValueError(f"a file of {len(data)} bytes; the store holds at most {self.max_bytes}")
        now = self.clock()
        self._expire(now)
        while self._files and (len(self._files) >= self.max_files or self._bytes + len(data) > self.max_bytes):
            self._drop(next(iter(self._files)))
        name = secrets.token_urlsafe(24) + suffix
        self._files[name] = StoredFile(filename, media_type, data, now + self.ttl_s)
        self._bytes += len(data)
        return name

    def get(self, name: str) -> StoredFile | None:
        self._expire(self.clock())
        return self._files.get(name)

    def __len__(self) -> int:
        return len(self._files)

    def _expire(self, now: float) -> None:
        while self._files:
            name, oldest = next(iter(self._files.items()))
            if oldest.expires > now:
                return
            self._drop(name)

    def _drop(self, name: str) -> None:
        self._bytes -= len(self._files.pop(name).data)
