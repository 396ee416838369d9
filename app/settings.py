"""Service settings, read from the environment with the ``TRANSLATOR_`` prefix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from model.engine.allocator import MallocChoice
from model.network.precision import Precision


class KeyLimits(BaseModel):
    """Limits one API key carries instead of the server-wide ones (None: the server's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    req_limit: int | None = Field(None, ge=0, description="requests per minute (0: no limit)")
    hourly_req_limit: int | None = Field(None, ge=0, description="requests per hour (0: no limit)")
    daily_req_limit: int | None = Field(None, ge=0, description="requests per day (0: no limit)")
    char_limit: int | None = Field(None, ge=0, description="characters per request (0: no limit)")


class Settings(BaseSettings):
    """Every knob of the service. Example: ``TRANSLATOR_DEVICE=cuda TRANSLATOR_MAX_WAIT_MS=5``."""

    model_config = SettingsConfigDict(env_prefix="TRANSLATOR_", frozen=True)

    weights_dir: Path = Field(Path("weights"), description="folder with one checkpoint folder per model")
    load_only: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="comma-separated language codes (LibreTranslate's --load-only): load only the checkpoints "
        "whose source and target are both listed; empty: all",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when available, else CPU")
    dtype: Literal["auto", Precision] = Field(
        "auto", description="auto: float16 on CUDA, float32 on CPU; int8: CPU only (needs AVX2)"
    )
    threads: int = Field(0, ge=0, description="torch CPU threads (0: torch's default)")
    shortlist: bool = Field(
        True,
        description="float precisions: score only the lexical shortlist a checkpoint ships (shortlist.safetensors, "
        "model/engine/shortlist.py): faster; a few sentences in a hundred may differ from whole-vocabulary decoding; "
        "false: the whole vocabulary (int8 always scores it: faster there)",
    )
    fused_step: bool = Field(
        True,
        description="float32 and int8 on the CPU: run the decoder step's attention, layer norms and beam bookkeeping, "
        "and (float32) every layer, the output projection included, and a shortlist's logits, on weights packed into "
        "panels (a pass's layers in one call), and (int8) the int8 products (every one on AVX2 and on "
        "AVX-512 with VNNI, a few rows on AVX-512 without it), on the fused C++ kernels (model/engine/fused.py; built "
        "once per CPU variant with the system's C++ compiler, ~20-60 s, cached): about half the time a sentence "
        "one at a time; false, or no compiler: torch's tensor operations, float32 layers on oneDNN (MKL on Intel CPUs)",
    )
    malloc: MallocChoice = Field(
        "auto",
        description="memory allocator (translator serve re-executes itself on it): auto: mimalloc where installed "
        "(Debian/Ubuntu: libmimalloc2.0; lower batch memory, model/engine/allocator.py), else glibc's malloc, tuned; "
        "mimalloc: refuse to start without it",
    )
    host: str = Field("0.0.0.0", description="address to listen on")
    port: int = Field(8000, ge=1, le=65535, description="TCP port to listen on")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="level of the JSON logs")

    max_batch_sentences: int = Field(64, ge=1, description="sentences decoded together (the running batch)")
    max_batch_tokens: int = Field(6000, ge=16, description="padded source tokens of the running batch")
    max_wait_ms: float = Field(
        5.0,
        ge=0,
        description="how long an idle model may wait for company; it waits only when sentences arrive "
        "often enough to expect some within this time",
    )
    join_group: int = Field(
        16,
        ge=1,
        description="under load (more sentences queued than the running batch has room for), they join it in "
        "groups of at least this many, one encoder pass each, instead of a few at every step; "
        "1: as soon as there is room",
    )
    max_join_wait_ms: float = Field(
        200.0,
        ge=0,
        description="the longest a queued sentence waits for its group (join_group) to form before it joins",
    )
    queue_size: int = Field(2048, ge=1, description="sentences waiting per model before 429")
    request_timeout_s: float = Field(30.0, gt=0, description="per request, queueing included (504 after)")
    drain_timeout_s: float = Field(20.0, ge=0, description="on shutdown, time to finish accepted requests")
    cache_size: int = Field(10000, ge=0, description="translations kept in the LRU cache (0: off)")

    max_text_chars: int = Field(5000, ge=1, description="characters per text item")
    max_items: int = Field(64, ge=1, description="texts per request (q as a list)")
    max_beam: int = Field(8, ge=1, description="largest beam_size accepted")
    max_alternatives: int = Field(4, ge=0, description="largest number of alternatives accepted")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="request bodies above this get 413")
    max_file_bytes: int = Field(
        5_000_000, ge=1024, description="POST /translate_file: files above this get 413 (instead of max_body_bytes)"
    )
    file_results_max: int = Field(100, ge=1, description="translated files kept for download (the oldest go first)")
    file_results_max_bytes: int = Field(
        50_000_000, ge=1024, description="bytes of translated files kept for download, all together (in memory)"
    )
    file_results_ttl_s: float = Field(600.0, gt=0, description="seconds a translated file can be downloaded")
    file_results_storage: str = Field(
        "memory://",
        pattern=r"^(memory|redis|rediss|unix)://",
        description="where translated files wait for download: memory:// (this process) or redis://host:6379 "
        "(shared by the replicas, so any of them answers the download)",
    )
    attention_max_tokens: int = Field(128, ge=1, description="longest text (tokens) /attention accepts")
    attention_max_cells: int = Field(1_000_000, ge=1, description="most attention values in one /attention reply")
    suggestions: bool = Field(False, description="accept POST /suggest (else 403) and keep suggestions in SQLite")
    data_dir: Path = Field(Path("data"), description="folder for the service's own data (suggestions.sqlite)")

    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated keys; empty: no authentication"
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list, description="comma-separated origins")

    # Per-client limits, named after LibreTranslate's (LT_REQ_LIMIT, ...): app/storage/ratelimit.py
    req_limit: int = Field(0, ge=0, description="requests per minute per client (API key, else address); 0: no limit")
    hourly_req_limit: int = Field(0, ge=0, description="requests per hour per client; 0: no limit")
    daily_req_limit: int = Field(0, ge=0, description="requests per day per client; 0: no limit")
    char_limit: int = Field(0, ge=0, description="characters per request, all texts together; 0: no limit")
    req_limit_storage: str = Field(
        "memory://",
        pattern=r"^(async\+)?(memory|redis|rediss|redis\+sentinel|redis\+cluster)://",
        description="where the rate-limit counters live: memory:// (this process) or redis://host:6379 "
        "(shared by every replica)",
    )
    api_key_limits: dict[str, KeyLimits] = Field(
        default_factory=dict,
        description='JSON: limits of particular API keys, e.g. {"KEY": {"req_limit": 600, "char_limit": 20000}} '
        "(fields: req_limit, hourly_req_limit, daily_req_limit, char_limit; absent: the server's); "
        "a key listed here is a valid key",
    )

    @field_validator("api_key_limits", mode="before")
    @classmethod
    def _json_object(cls, value: object) -> object:
        """A flag's value is text: decode it as the environment variable's is."""
        if isinstance(value, str):
            return json.loads(value) if value.strip() else {}
        return value

    @property
    def known_keys(self) -> frozenset[str]:
        """Every valid API key: those of ``api_keys`` and those with limits of their own."""
        return frozenset(self.api_keys) | frozenset(self.api_key_limits)

    @field_validator("api_keys", "cors_origins", "load_only", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value
