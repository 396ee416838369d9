"""Request and response bodies (pydantic lives at the HTTP edge only)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

Kind = Literal["cross", "encoder", "decoder"]


class TranslateRequest(BaseModel):
    """LibreTranslate's /translate body plus decoding options. Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    q: StrictStr | list[StrictStr] = Field(..., description="a text, or a list of texts")
    source: StrictStr = Field(..., description='source language code, e.g. de; "auto" detects it per text')
    target: StrictStr = Field(..., description="target language code, e.g. en")
    format: Literal["text", "html"] = Field(
        "text",
        description='"html": translate the text of an HTML fragment or document and keep its markup '
        "(no alternatives or details then)",
    )
    alternatives: int = Field(0, ge=0, description="extra translations to return (n-best)")
    beam_size: int | None = Field(
        None, ge=1, description="default: the model card's beam size; widened to alternatives + 1 when smaller"
    )
    max_length: int | None = Field(None, ge=1, description="most tokens to generate per sentence")
    repetition_penalty: float | None = Field(
        None,
        gt=0,
        le=10,
        description="penalize pieces already generated (CTranslate2's and transformers' "
        "meaning; 1: off); default: the model card's",
    )
    no_repeat_ngram_size: int | None = Field(
        None, ge=0, le=16, description="never repeat an n-gram of this many pieces (0: off); default: the model card's"
    )
    details: bool = Field(False, description="add tokens, scores, token counts and timings per item")
    api_key: str | None = Field(None, description="LibreTranslate-style API key (or X-API-Key header)")


class SentenceDetails(BaseModel):
    source: str
    translation: str
    source_tokens: list[str]
    target_tokens: list[str]
    score: float
    confidence: int = Field(
        description="0-100: geometric mean of the pieces' probabilities (docs/decoding.md#confidence)"
    )
    truncated: bool
    cached: bool


class Timings(BaseModel):
    queue_ms: float
    total_ms: float


class ItemDetails(BaseModel):
    tokens: list[str] = Field(description="target tokens of the best translation, all sentences")
    score: float = Field(description="mean length-normalized log-probability over sentences")
    confidence: int = Field(description="0-100: the least confident sentence's (docs/decoding.md#confidence)")
    source_token_count: int
    target_token_count: int
    truncated: bool = Field(description="a sentence hit the length limit without ending")
    sentences: list[SentenceDetails]
    timings: Timings
    models: list[str] = Field(description="the models that ran, in order (two when translated through English)")


class DetectionResult(BaseModel):
    language: str = Field(description="ISO 639-1 code")
    confidence: float = Field(ge=0, le=100, description="percent")


class TranslateResponse(BaseModel):
    translatedText: str | list[str]
    alternatives: list[str] | list[list[str]] | None = None
    details: ItemDetails | list[ItemDetails] | None = None
    detectedLanguage: DetectionResult | list[DetectionResult] | None = Field(
        None, description='with source "auto": the language each text was taken to be in'
    )


class TranslateFileResponse(BaseModel):
    """LibreTranslate's /translate_file answer."""

    translatedFileUrl: str = Field(description="where to GET the translated file (kept for a while, in memory)")
    detectedLanguage: DetectionResult | None = Field(
        None, description='with source "auto": the language the document was taken to be in'
    )


class DetectRequest(BaseModel):
    """LibreTranslate's /detect body."""

    model_config = ConfigDict(extra="ignore")

    q: StrictStr = Field(..., description="the text whose language is wanted")
    api_key: str | None = Field(None, description="LibreTranslate-style API key (or X-API-Key header)")


class SuggestRequest(BaseModel):
    """LibreTranslate's /suggest body: a text and the translation the user suggests for it."""

    model_config = ConfigDict(extra="ignore")

    q: StrictStr = Field(..., description="the original text")
    s: StrictStr = Field(..., description="the suggested translation")
    source: StrictStr
    target: StrictStr
    api_key: str | None = None


class SuggestResponse(BaseModel):
    success: bool


class LanguageRef(BaseModel):
    code: str
    name: str


class FrontendLanguages(BaseModel):
    source: LanguageRef
    target: LanguageRef


class FrontendSettings(BaseModel):
    """LibreTranslate's /frontend/settings (what clients read before translating)."""

    apiKeys: bool = Field(description="whether API keys are in use")
    keyRequired: bool = Field(description="whether a request needs a key")
    charLimit: int = Field(description="characters per request (per text if no request limit is set)")
    frontendTimeout: int = Field(description="ms a frontend waits after typing before translating")
    suggestions: bool
    filesTranslation: bool
    supportedFilesFormat: list[str]
    language: FrontendLanguages


class AttentionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    q: StrictStr = Field(..., description="one text (translated as a single sequence)")
    source: StrictStr
    target: StrictStr
    beam_size: int | None = Field(None, ge=1)
    layers: list[int] | None = Field(None, description="layer indices (default: all)")
    heads: list[int] | None = Field(None, description="head indices (default: all)")
    kinds: list[Kind] | None = Field(None, description="default: cross, encoder and decoder")
    level: Literal["subword", "word"] = "subword"
    api_key: str | None = None


class AlignmentLink(BaseModel):
    target_index: int
    source_index: int
    target_token: str
    source_token: str
    weight: float


class AttentionResponse(BaseModel):
    translatedText: str
    source: str
    target: str
    level: str
    source_tokens: list[str]
    target_tokens: list[str]
    target_input_tokens: list[str]
    n_layers: int
    n_encoder_layers: int
    n_decoder_layers: int
    n_heads: int
    layers: list[int]
    heads: list[int]
    attention: dict[str, Any] = Field(description="kind -> [layer][head][query][key]")
    alignment: list[AlignmentLink]


class Language(BaseModel):
    code: str
    name: str
    targets: list[str]


class ErrorResponse(BaseModel):
    error: str
    error_type: str


class DirectionInfo(BaseModel):
    """One loaded model: its direction, network, where and how it runs, measured quality."""

    source: str
    target: str
    model: dict[str, Any] = Field(description="the model config (config.json's model section)")
    parameters: int
    n_layers: int
    n_encoder_layers: int
    n_heads: int
    device: str
    dtype: str
    vocabulary: Literal["shortlist", "full"] = Field(
        description="what a decoder step scores: the checkpoint's lexical shortlist (TRANSLATOR_SHORTLIST) "
        "or every piece"
    )
    kernel: str = Field(description="what runs the linear layers (model.engine.kernels: onednn, aten, fbgemm-int8)")
    step_kernel: str = Field(
        description="what runs the decoder step's layers (aten: F.linear, on Intel CPUs; wx: MKL as W·xᵀ; or as kernel)"
    )
    cpu_isa: str | None = Field(description="the CPU instruction set the kernels use (null on a GPU)")
    fused_step: str | None = Field(
        description="the fused decoder-step kernels running (model.engine.fused: avx512vnni, avx512, avx2 or "
        "baseline build); "
        "null where they are off (TRANSLATOR_FUSED_STEP=off), do not apply, or could not be built"
    )
    int8_products: str | None = Field(
        description="int8: what computes the matrix products in decoding: the fused kernels' own int8 product "
        "(every row count on AVX2 and AVX-512 VNNI, a few rows on AVX-512 without VNNI, model.engine.fused INT8_ROWS) "
        "or fbgemm's; null for other dtypes"
    )
    kv_cache: str = Field(
        description="the dtype the decoder's K/V cache is stored in: float16 under int8 where the fused kernels "
        "convert with F16C (half the memory), else the activations' (float32 on the CPU)"
    )
    max_source_tokens: int
    recommended_decoding: dict[str, Any] = Field(description="the model card's decoding options")
    quality: dict[str, Any] = Field(description="measured scores (metrics.json)")


class Limits(BaseModel):
    max_text_chars: int
    max_items: int
    max_beam: int
    max_alternatives: int
    max_body_bytes: int
    request_timeout_s: float
    attention_max_tokens: int


class Batching(BaseModel):
    max_batch_sentences: int
    max_batch_tokens: int
    max_wait_ms: float
    queue_size: int


class InfoResponse(BaseModel):
    version: str
    ready: bool
    malloc: str = Field(description="the allocator serving the process's memory: mimalloc or glibc (TRANSLATOR_MALLOC)")
    directions: list[DirectionInfo]
    limits: Limits
    batching: Batching


class HealthResponse(BaseModel):
    status: Literal["ok", "unhealthy"]
    error: str | None = Field(None, description="why the process cannot serve (when unhealthy)")


class ReadyResponse(BaseModel):
    status: Literal["ready"]
    directions: list[str] = Field(description="the directions loaded, e.g. de-en")
