"""Training configuration: one TOML file fully describes a shipped model's recipe."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from model.network.config import ModelConfig

T = TypeVar("T")


@dataclass(frozen=True)
class DataConfig:
    dir: str = "../shared/data/multi30k"
    source: str = "de"
    target: str = "en"
    train: str = "train"
    valid: str = "val"
    test: str = "test_2016_flickr"
    max_ratio: float = 3.0
    train_limit: int = 0  # use only the first N training pairs (0: all); for smoke runs
    eval_limit: int = 0  # score only the first N validation/test pairs (0: all)
    # many-to-many: "src-tgt" directions trained together in one model, each source sentence led
    # by its target language's tag (model.network.tokenizer.target_tag); empty: source -> target alone
    directions: tuple[str, ...] = ()
    # extra training pairs beside [train] (one-direction runs): [source file, target file] each,
    # aligned line by line, "{dir}" standing for ``dir``; e.g. a shipped model's translations of
    # the training sources (sequence-level distillation) or of its targets (back-translation),
    # written by ``python -m model.training.distill``. The tokenizer is trained on [train] alone.
    synthetic: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        pairs = tuple(tuple(p) for p in self.synthetic)
        if any(len(p) != 2 or not all(isinstance(x, str) and x for x in p) for p in pairs):
            raise ValueError(f"[data] synthetic: [source file, target file] pairs expected, got {self.synthetic!r}")
        if pairs and self.directions:
            raise ValueError("[data] synthetic: one-direction runs only (not with directions)")
        object.__setattr__(self, "synthetic", pairs)

    def synthetic_files(self) -> list[tuple[str, str]]:
        """The synthetic pairs' file paths, "{dir}" replaced by the data folder."""
        return [(s.replace("{dir}", self.dir), t.replace("{dir}", self.dir)) for s, t in self.synthetic]

    def pairs(self) -> list[tuple[str, str]]:
        """The (source, target) language pairs this run trains."""
        if not self.directions:
            return [(self.source, self.target)]
        pairs = [tuple(d.split("-")) for d in self.directions]
        if any(len(p) != 2 or p[0] == p[1] or not all(p) for p in pairs) or len(set(pairs)) != len(pairs):
            raise ValueError(f"[data] directions: distinct 'src-tgt' pairs expected, got {list(self.directions)}")
        return [(p[0], p[1]) for p in pairs]


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = 8000
    model_type: Literal["unigram", "bpe"] = "unigram"
    character_coverage: float = 1.0
    # subword regularization (Kudo 2018): each epoch the training sentences, both sides, are
    # segmented anew by sampling from the unigram model, segmentation probabilities raised to
    # ``sampling_alpha`` (sentencepiece's alpha: smaller is flatter); 0: the best segmentation
    # always. ``sampling_nbest`` -1 samples from every segmentation, N > 1 from the N best.
    # Validation, evaluation and serving always use the best segmentation.
    sampling_alpha: float = 0.0
    sampling_nbest: int = -1
    # a sentencepiece model file to use instead of training one (relative paths from the working
    # folder, like [data] dir): sentencepiece's training gives another model under another
    # version of it (0.2.0, 0.2.1 and 0.2.3 each did on the same sentences), so a config that
    # reproduces shipped weights names their spm.model; vocab_size must match it
    model: str = ""

    def __post_init__(self) -> None:
        if not 0.0 <= self.sampling_alpha <= 1.0:
            raise ValueError(f"[tokenizer] sampling_alpha: 0 (off) to 1 expected, got {self.sampling_alpha}")
        if self.sampling_nbest == 0 or self.sampling_nbest == 1 or self.sampling_nbest < -1:
            raise ValueError(f"[tokenizer] sampling_nbest: -1 (all) or N > 1 expected, got {self.sampling_nbest}")
        if self.sampling_alpha and self.model_type != "unigram":
            raise ValueError("[tokenizer] sampling_alpha: samples a unigram model's segmentations only")


@dataclass(frozen=True)
class OptimConfig:
    seed: int = 1
    max_epochs: int = 40
    max_tokens: int = 4096  # padded tokens per batch (max of source/target side)
    accumulate: int = 1
    lr: float = 7e-4  # peak learning rate, reached at the end of warmup
    warmup_steps: int = 1000
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    label_smoothing: float = 0.1
    bf16: bool = True  # bf16 autocast where the device runs it natively (else float32, logged)
    patience: int = 8  # epochs without a better validation BLEU before stopping
    average: Literal["last", "best"] = "last"
    average_count: int = 5
    # the final weights: "val_bleu" keeps whichever of the average and the best single epoch
    # scores higher in greedy validation BLEU; "averaged" always ships the average
    select: Literal["val_bleu", "averaged"] = "val_bleu"
    threads: int = 0  # CPU threads for torch; 0 = torch's default


@dataclass(frozen=True)
class RecommendedDecoding:
    beam_size: int = 5
    length_penalty: float = 0.6
    max_length_a: float = 1.5
    max_length_b: int = 10
    # a many-to-many model's length penalty per direction ("cs-en" = 1.0) where val chose
    # another than ``length_penalty`` (``checkpoint.recommended_decoding`` applies it)
    length_penalty_by_direction: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainConfig:
    name: str
    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    decoding: RecommendedDecoding = field(default_factory=RecommendedDecoding)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _build(cls: type[T], table: dict[str, Any], where: str) -> T:
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"[{where}]: unknown keys {unknown}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}
    return cls(**values)


def load_train_config(path: str | Path) -> TrainConfig:
    """Parse a TOML training config. The [model] table omits vocabulary sizes:
    they come from [tokenizer].vocab_size (a joint vocabulary)."""
    raw = tomllib.loads(Path(path).read_text())
    known = {"name", "model", "data", "tokenizer", "optim", "decoding"}
    if unknown := sorted(set(raw) - known):
        raise ValueError(f"{path}: unknown tables {unknown}")
    tok = _build(TokenizerConfig, raw.get("tokenizer", {}), "tokenizer")
    model_table = {"src_vocab_size": tok.vocab_size, "tgt_vocab_size": tok.vocab_size, **raw.get("model", {})}
    return TrainConfig(
        name=raw.get("name", Path(path).stem),
        model=ModelConfig.from_dict(model_table),
        data=_build(DataConfig, raw.get("data", {}), "data"),
        tokenizer=tok,
        optim=_build(OptimConfig, raw.get("optim", {}), "optim"),
        decoding=_build(RecommendedDecoding, raw.get("decoding", {}), "decoding"),
    )
