"""Training configuration: one TOML file fully describes a shipped model's recipe."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from model.checkpoint import SPM, read_meta
from model.network.config import ModelConfig

T = TypeVar("T")

SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class CorpusConfig:
    """One source of the user's parallel text (``[[data.corpora]]``): two aligned text files
    (``files = [source, target]``: line i of one translates line i of the other), or one TSV or
    JSONL file (``file``) with a source and a target column. Plain or gzip (a name ending in
    .gz); TSV or JSONL by the name (``.tsv``, ``.jsonl``, before any ``.gz``). "{dir}" in a path
    stands for ``[data] dir``."""

    files: tuple[str, ...] = ()
    file: str = ""
    # TSV: the two columns' 0-based indices (default 0 and 1), or names in a header line;
    # JSONL: the two keys of each object (default the language codes, e.g. {"de": ..., "en": ...}),
    # dotted for nested objects ("translation.de")
    columns: tuple[int | str, ...] = ()
    header: bool = False  # TSV: the first line names the columns (implied by column names)
    split: str = "train"  # train, valid (validation loss and BLEU each epoch) or test (scored at the end)
    # train: how often each pair is seen per epoch: 2 twice, 0.1 a tenth of the pairs (drawn anew
    # each epoch), e.g. a small corpus of corrections weighted up and the original data down
    weight: float = 1.0
    name: str = ""  # in the logs and data.json (default: the file's name)

    def __post_init__(self) -> None:
        where = f"[[data.corpora]] {self.name or self.file or list(self.files)}"
        if bool(self.files) == bool(self.file):
            raise ValueError(f"{where}: give files = [source, target] or file = a TSV/JSONL file, not both")
        if self.files and (len(self.files) != 2 or not all(isinstance(f, str) and f for f in self.files)):
            raise ValueError(f"{where}: files = [source file, target file] expected, got {list(self.files)!r}")
        if self.file and self.kind not in ("tsv", "jsonl"):
            raise ValueError(f"{where}: file must end in .tsv or .jsonl (then .gz or not), got {self.file!r}")
        if self.columns and (self.files or len(self.columns) != 2):
            raise ValueError(f"{where}: columns = [source, target] of a TSV/JSONL file, got {list(self.columns)!r}")
        if self.kind == "jsonl" and any(not isinstance(c, str) for c in self.columns):
            raise ValueError(f"{where}: a JSONL file's columns are keys (strings)")
        if self.split not in SPLITS:
            raise ValueError(f"{where}: split must be one of {list(SPLITS)}, got {self.split!r}")
        if not (isinstance(self.weight, int | float) and 0 < self.weight <= 1000):
            raise ValueError(f"{where}: weight must be above 0 (and at most 1000), got {self.weight!r}")
        if self.weight != 1.0 and self.split != "train":
            raise ValueError(f"{where}: weights are for training corpora")

    @property
    def kind(self) -> str:
        """ "pair" (two aligned files), "tsv" or "jsonl"."""
        if self.files:
            return "pair"
        name = self.file.removesuffix(".gz")
        return "tsv" if name.endswith(".tsv") else "jsonl" if name.endswith(".jsonl") else "?"

    @property
    def label(self) -> str:
        return self.name or Path(self.file or self.files[0]).name


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
    # The user's own corpora ([[data.corpora]] tables, ``CorpusConfig``) instead of the Multi30k
    # splits in ``dir``: streamed from disk each epoch (model.training.stream), so a corpus larger
    # than memory trains in flat memory. One-direction runs.
    corpora: tuple[CorpusConfig, ...] = ()
    shuffle_buffer: int = 100_000  # pairs held to shuffle the stream (the bound on its memory)
    bucket: int = 10_000  # pairs tokenized and length-sorted into batches at once
    dedup_mb: int = 64  # memory of the duplicate filter (a Bloom filter, per process); 0: keep duplicates
    sample_pairs: int = 200_000  # training pairs (a hash-chosen sample) the tokenizer and shortlist learn from

    def __post_init__(self) -> None:
        pairs = tuple(tuple(p) for p in self.synthetic)
        if any(len(p) != 2 or not all(isinstance(x, str) and x for x in p) for p in pairs):
            raise ValueError(f"[data] synthetic: [source file, target file] pairs expected, got {self.synthetic!r}")
        if pairs and self.directions:
            raise ValueError("[data] synthetic: one-direction runs only (not with directions)")
        object.__setattr__(self, "synthetic", pairs)
        corpora = []
        for entry in self.corpora:
            if isinstance(entry, dict):
                entry = _build(CorpusConfig, entry, "data.corpora")
            corpora.append(entry)
        object.__setattr__(self, "corpora", tuple(corpora))
        if corpora:
            if self.directions or pairs:
                raise ValueError("[data] corpora: one-direction runs (not with directions or synthetic)")
            for split in ("train", "valid"):
                if not any(c.split == split for c in corpora):
                    raise ValueError(f"[data] corpora: no {split} corpus (split = {split!r})")
        for name in ("shuffle_buffer", "bucket", "sample_pairs"):
            if getattr(self, name) < 1:
                raise ValueError(f"[data] {name} must be at least 1")
        if self.dedup_mb < 0:
            raise ValueError("[data] dedup_mb must be 0 (off) or more")

    def corpora_of(self, split: str) -> list[CorpusConfig]:
        return [c for c in self.corpora if c.split == split]

    def path(self, name: str) -> Path:
        """A corpus file's path, "{dir}" replaced by the data folder."""
        return Path(name.replace("{dir}", self.dir))

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
    log_every: int = 0  # every N updates, the update's loss per token into OUT/steps.jsonl (0: none)


@dataclass(frozen=True)
class RecommendedDecoding:
    beam_size: int = 5
    length_penalty: float = 0.6
    max_length_a: float = 1.5
    max_length_b: int = 10
    # a many-to-many model's length penalty per direction ("cs-en" = 1.0) where val chose
    # another than ``length_penalty`` (``checkpoint.recommended_decoding`` applies it)
    length_penalty_by_direction: dict[str, float] = field(default_factory=dict)
    # the guards against loops a card may carry (``DecodingOptions``; 0 and 1: off): a fine-tuned
    # model keeps its starting card's
    no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.0
    # a many-to-many model's n-gram size per direction where val chose another (bench.repetition)
    no_repeat_ngram_size_by_direction: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainConfig:
    name: str
    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    decoding: RecommendedDecoding = field(default_factory=RecommendedDecoding)
    # a checkpoint folder the run starts from (``--init``: fine-tuning): its weights, vocabulary
    # and architecture (``load_train_config`` takes them from its config.json)
    init: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _build(cls: type[T], table: dict[str, Any], where: str) -> T:
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"[{where}]: unknown keys {unknown}")
    if not isinstance(table, dict):
        raise ValueError(f"[{where}]: a table expected, got {table!r}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}
    return cls(**values)


# What a fine-tuning config may set differently from the checkpoint it starts from: the rest of
# [model] is the checkpoint's architecture.
TUNABLE = ("dropout", "attention_dropout", "activation_dropout")


def load_train_config(path: str | Path, init: str | Path | None = None) -> TrainConfig:
    """Parse a TOML training config. The [model] table omits vocabulary sizes:
    they come from [tokenizer].vocab_size (a joint vocabulary).

    ``init``, a checkpoint folder (shipped, trained or imported), makes a fine-tuning run of it:
    the architecture and vocabulary are the checkpoint's (its config.json and spm.model; a [model]
    table may change only the dropouts), and so is the recommended decoding unless the config has
    a [decoding] table."""
    raw = tomllib.loads(Path(path).read_text())
    known = {"name", "model", "data", "tokenizer", "optim", "decoding"}
    if unknown := sorted(set(raw) - known):
        raise ValueError(f"{path}: unknown tables {unknown}")
    tok = _build(TokenizerConfig, raw.get("tokenizer", {}), "tokenizer")
    model_table = {"src_vocab_size": tok.vocab_size, "tgt_vocab_size": tok.vocab_size, **raw.get("model", {})}
    decoding = _build(RecommendedDecoding, raw.get("decoding", {}), "decoding")
    if init is not None:
        card = read_meta(init)
        model_table = dict(card["model"])
        for key, value in raw.get("model", {}).items():
            if key not in TUNABLE and key in model_table and model_table[key] != value:
                raise ValueError(
                    f"{path}: [model] {key} = {value!r}, but {init} has {model_table[key]!r}: "
                    f"a run started from a checkpoint keeps its architecture (only {', '.join(TUNABLE)} may change)"
                )
            model_table[key] = value
        vocab = int(model_table["tgt_vocab_size"])
        tok = dataclasses.replace(tok, vocab_size=vocab, model=str(Path(init) / SPM))
        if "decoding" not in raw:
            card_decoding = {k: v for k, v in card.get("decoding", {}).items() if k in _names(RecommendedDecoding)}
            decoding = RecommendedDecoding(**card_decoding)
    return TrainConfig(
        name=raw.get("name", Path(path).stem),
        model=ModelConfig.from_dict(model_table),
        data=_build(DataConfig, raw.get("data", {}), "data"),
        tokenizer=tok,
        optim=_build(OptimConfig, raw.get("optim", {}), "optim"),
        decoding=decoding,
        init="" if init is None else str(init),
    )
