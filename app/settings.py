"""Service settings, read from the environment with the ``TRANSLATOR_`` prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from model.precision import Precision


class Settings(BaseSettings):
    """Every knob of the service. Example: ``TRANSLATOR_DEVICE=cuda TRANSLATOR_MAX_WAIT_MS=5``."""

    model_config = SettingsConfigDict(env_prefix="TRANSLATOR_", frozen=True)

    weights_dir: Path = Field(Path("weights"), description="folder with one checkpoint folder per direction")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when available, else CPU")
    dtype: Literal["auto", Precision] = Field(
        "auto", description="auto: float16 on CUDA, float32 on CPU; int8: CPU only (needs AVX2)"
    )
    threads: int = Field(0, ge=0, description="torch CPU threads (0: torch's default)")
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
    queue_size: int = Field(2048, ge=1, description="sentences waiting per model before 429")
    request_timeout_s: float = Field(30.0, gt=0, description="per request, queueing included (504 after)")
    drain_timeout_s: float = Field(20.0, ge=0, description="on shutdown, time to finish accepted requests")
    cache_size: int = Field(10000, ge=0, description="translations kept in the LRU cache (0: off)")

    max_text_chars: int = Field(5000, ge=1, description="characters per text item")
    max_items: int = Field(64, ge=1, description="texts per request (q as a list)")
    max_beam: int = Field(8, ge=1, description="largest beam_size accepted")
    max_alternatives: int = Field(4, ge=0, description="largest number of alternatives accepted")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="request bodies above this get 413")
    attention_max_tokens: int = Field(128, ge=1, description="longest text (tokens) /attention accepts")
    attention_max_cells: int = Field(1_000_000, ge=1, description="most attention values in one /attention reply")

    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated keys; empty: no authentication"
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list, description="comma-separated origins")

    @field_validator("api_keys", "cors_origins", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value
