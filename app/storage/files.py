"""Translated files (``POST /translate_file``) kept until they are fetched
(``GET /download_file/{name}``) or expire: in this process's memory (``MemoryFileStore``), or
in Redis (``RedisFileStore``, ``TRANSLATOR_FILE_RESULTS_STORAGE=redis://...``) so that a
download reaches the file whichever replica answers it. Never on disk: the pods' root
filesystem is read-only, and no name a client sends ever reaches a filesystem. Names are
random and unguessable (``secrets.token_urlsafe``): knowing one is what entitles a client to
the file.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError


@dataclass(frozen=True)
class StoredFile:
    filename: str
    media_type: str
    data: bytes
    expires: float  # the store's clock


class FileStoreError(Exception):
    """The store cannot be reached (Redis down): the route answers 503."""


class FileStore(Protocol):
    async def put(self, filename: str, media_type: str, data: bytes, suffix: str) -> str:
        """Keep a file (ValueError if it alone is over the store's bytes); its new name (random,
        unguessable, ending in ``suffix``)."""
        ...

    async def get(self, name: str) -> StoredFile | None:
        """The file, or None once it expired or was evicted (or never was)."""
        ...


def new_name(suffix: str) -> str:
    return secrets.token_urlsafe(24) + suffix


class MemoryFileStore:
    """Translated files in memory, at most ``max_files`` of them and ``max_bytes`` together
    (the oldest go first), each for ``ttl_s`` seconds. Used from the event loop only."""

    def __init__(
        self, max_files: int, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_files, self.max_bytes, self.ttl_s, self.clock = max_files, max_bytes, ttl_s, clock
        self._files: OrderedDict[str, StoredFile] = OrderedDict()  # oldest first: expiry order too
        self._bytes = 0

    async def put(self, filename: str, media_type: str, data: bytes, suffix: str) -> str:
        if len(data) > self.max_bytes:
            raise ValueError(f"a file of {len(data)} bytes; the store holds at most {self.max_bytes}")
        now = self.clock()
        self._expire(now)
        while self._files and (len(self._files) >= self.max_files or self._bytes + len(data) > self.max_bytes):
            self._drop(next(iter(self._files)))
        name = new_name(suffix)
        self._files[name] = StoredFile(filename, media_type, data, now + self.ttl_s)
        self._bytes += len(data)
        return name

    async def get(self, name: str) -> StoredFile | None:
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


class RedisFileStore:
    """Translated files in Redis, shared by every replica: each a hash that expires after
    ``ttl_s`` seconds, the newest ``max_files`` names listed and older ones deleted, no file
    over ``max_bytes`` (Redis's own ``maxmemory`` bounds the bytes of all)."""

    PREFIX = "translator:file:"
    INDEX = "translator:files"

    def __init__(self, url: str, max_files: int, max_bytes: int, ttl_s: float) -> None:
        self.redis = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self.max_files, self.max_bytes, self.ttl_ms = max_files, max_bytes, max(1, round(1000 * ttl_s))

    async def put(self, filename: str, media_type: str, data: bytes, suffix: str) -> str:
        if len(data) > self.max_bytes:
            raise ValueError(f"a file of {len(data)} bytes; the store holds at most {self.max_bytes}")
        name = new_name(suffix)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(self.PREFIX + name, mapping={"filename": filename, "media_type": media_type, "data": data})
                pipe.pexpire(self.PREFIX + name, self.ttl_ms)
                pipe.lpush(self.INDEX, name)
                pipe.lrange(self.INDEX, self.max_files, -1)
                pipe.ltrim(self.INDEX, 0, self.max_files - 1)
                done = await pipe.execute()
            evicted = [n.decode() for n in done[3]]
            if evicted:
                await self.redis.delete(*(self.PREFIX + n for n in evicted))
        except RedisError as err:
            raise FileStoreError(f"file storage unavailable: {type(err).__name__}") from None
        return name

    async def get(self, name: str) -> StoredFile | None:
        try:
            # (redis' stubs type hgetall for its sync and async clients at once)
            found = await cast(Awaitable[dict[bytes, bytes]], self.redis.hgetall(self.PREFIX + name))
            ttl_ms = await self.redis.pttl(self.PREFIX + name) if found else -1
        except RedisError as err:
            raise FileStoreError(f"file storage unavailable: {type(err).__name__}") from None
        if not found or not {b"filename", b"media_type", b"data"} <= found.keys():
            return None
        expires = time.monotonic() + max(ttl_ms, 0) / 1000
        return StoredFile(found[b"filename"].decode(), found[b"media_type"].decode(), found[b"data"], expires)


def file_store(storage: str, max_files: int, max_bytes: int, ttl_s: float) -> FileStore:
    """``memory://`` (this process) or ``redis://host:port/db`` (shared by the replicas)."""
    if storage.startswith(("redis://", "rediss://", "unix://")):
        return RedisFileStore(storage, max_files, max_bytes, ttl_s)
    return MemoryFileStore(max_files, max_bytes, ttl_s)
