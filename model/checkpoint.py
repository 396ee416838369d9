"""Checkpoint folders: ``model.safetensors`` + ``config.json`` + ``spm.model`` (never pickle).

``load`` validates everything it reads and raises ``CheckpointError`` with a message that
names the file and the problem, instead of a traceback from deep inside torch.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from model import kernels, shortlist
from model.config import ModelConfig
from model.data import read_parallel, split_file
from model.decoding import DecodingOptions
from model.kernels import KernelPlan
from model.shortlist import Shortlist
from model.tokenizer import Tokenizer, TokenizerError, target_prefix
from model.transformer import Transformer

log = logging.getLogger(__name__)

WEIGHTS, CONFIG, SPM, METRICS = "model.safetensors", "config.json", "spm.model", "metrics.json"
# Weights above this size are written as shards (model-00001-of-00003.safetensors, ...): every
# file of a checkpoint stays under 16 MiB (what a file transfer of the GPU machine takes back).
SHARD_BYTES = 15 * 2**20
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint folder is missing a file, or a file is corrupt or does not match."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: the network (eval mode), its tokenizer and config.json's content."""

    model: Transformer
    tokenizer: Tokenizer
    meta: dict[str, Any]
    path: Path
    plan: KernelPlan

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def source_prefix(self, target: str) -> tuple[int, ...]:
        """What leads every source translated into ``target``: a many-to-many model's target
        tag (``target_prefix``), nothing for a one-direction model."""
        return target_prefix(self.tokenizer, target) if self.meta.get("target_tags") else ()


def unique_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with tied tensors stored once (the first name wins)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        if tensor.is_meta:
            raise CheckpointError(
                f"{name}: released for inference (model.kernels.release_float_weights); "
                "load the checkpoint with keep_float_weights=True to save it"
            )
        key = tensor.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().contiguous()
    return out


def save(
    path: str | Path,
    model: Transformer,
    tokenizer: Tokenizer,
    meta: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a checkpoint folder. ``meta`` goes into config.json beside the model config."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to("cpu", dtype if v.is_floating_point() else v.dtype) for k, v in unique_state(model).items()}
    for old in weight_files(path):
        old.unlink()
    shards = _shards(tensors)
    for i, shard in enumerate(shards, 1):
        name = WEIGHTS if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
    (path / SPM).write_bytes(tokenizer.model_proto)
    config = {
        **(meta or {}),
        "format_version": FORMAT_VERSION,
        "model": model.config.to_dict(),
        "tokenizer": {"type": "sentencepiece", "file": SPM, "vocab_size": tokenizer.vocab_size},
        "storage_dtype": str(dtype).removeprefix("torch."),
    }
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return path


def _shards(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, cut into groups of at most ``SHARD_BYTES`` (a larger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def weight_files(path: str | Path) -> list[Path]:
    """A checkpoint folder's weights: model.safetensors, or its shards in order."""
    path = Path(path)
    single = path / WEIGHTS
    return [single] if single.is_file() else sorted(path.glob("model-*-of-*.safetensors"))


def directions(meta: dict[str, Any]) -> list[tuple[str, str]]:
    """The (source, target) pairs a checkpoint translates: its one direction, or a
    many-to-many model's list (each source led by its target's tag, ``target_tag``)."""
    if "directions" in meta:
        return [(source, target) for source, target in (d.split("-", 1) for d in meta["directions"])]
    return [(str(meta["source_lang"]), str(meta["target_lang"]))]


def read_meta(path: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint folder, validated to hold a model config."""
    file = Path(path) / CONFIG
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (is {path} a checkpoint folder?)")
    try:
        meta = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file}: not valid JSON ({err})") from err
    if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
        raise CheckpointError(f"{file}: no 'model' section")
    return meta


def recommended_decoding(meta: dict[str, Any], direction: str | None = None) -> dict[str, Any]:
    """The model card's recommended decoding (config.json "decoding") for one direction: a
    many-to-many card's ``length_penalty_by_direction`` entry, where it has one, replaces the
    length penalty."""
    card = dict(meta.get("decoding", {}))
    by_direction = card.pop("length_penalty_by_direction", None) or {}
    if direction in by_direction:
        card["length_penalty"] = float(by_direction[direction])
    return card


def decoding_options(
    meta: dict[str, Any],
    beam_size: int | None = None,
    n_best: int = 1,
    max_length: int | None = None,
    direction: str | None = None,
) -> DecodingOptions:
    """A request's options on top of the model card's recommended decoding (config.json
    "decoding": beam, length penalty, length limits; ``recommended_decoding`` for ``direction``
    "src-tgt"): the one place both the service and ``model.evaluate`` build them. ``n_best``
    hypotheses come from one beam, so a narrower beam is widened to ``n_best``. Raises
    ``ValueError`` for options no search can run."""
    card = recommended_decoding(meta, direction)
    beam = max(beam_size if beam_size is not None else int(card.get("beam_size", 4)), n_best)
    card.update(beam_size=beam, n_best=n_best, max_length=max_length)
    return DecodingOptions(**card)


def model_config(meta: dict[str, Any], where: Path) -> ModelConfig:
    try:
        return ModelConfig.from_dict(meta["model"])
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{where / CONFIG}: {err}") from err


def load(
    path: str | Path,
    device: str | torch.device = "cpu",
    precision: str = "float32",
    features: kernels.CpuFeatures | None = None,
    keep_float_weights: bool = False,
    fused: bool | None = None,
) -> Checkpoint:
    """Load and validate a checkpoint folder onto ``device`` for inference at ``precision``
    (float32, bfloat16, float16 or int8; eval mode), with the linear kernels ``kernels.choose``
    picks for it and this CPU (or ``features``). Layers that run on packed copies (int8, float32
    on oneDNN, float32 on the fused kernels' panels: a plan on ``panels``) give their float
    weights up (``kernels.release_float_weights``; the output
    projection too, its embeddings kept for the lookups, in float16 where exact:
    ``release_output_projection``), so the model is for inference only; ``keep_float_weights``
    keeps them (converters and tools that read the weights). ``fused``: whether the decoder step
    runs the fused kernels (``model.fused``; default ``TRANSLATOR_FUSED_STEP``, on). Raises
    ``kernels.UnsupportedPrecision`` before reading anything when the precision cannot run here."""
    plan = kernels.choose(device, precision, features, fused=fused)
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint folder not found")
    meta = read_meta(path)
    config = model_config(meta, path)
    try:
        tokenizer = Tokenizer.load(path / SPM)
    except TokenizerError as err:
        raise CheckpointError(f"{path / SPM}: {err}") from err
    if tokenizer.vocab_size != config.tgt_vocab_size:
        raise CheckpointError(
            f"{path / SPM}: vocabulary of {tokenizer.vocab_size} pieces, but {CONFIG} says {config.tgt_vocab_size}"
        )
    model = Transformer(config)
    load_weights(model, path)
    model.to(device=device, dtype=plan.dtype).eval()
    kernels.install(model, plan, model.step_linears())
    if plan.kernel == "panels" and model.fused_step is None:  # a compiler, but the kernels did not build (logged)
        plan = kernels.choose(device, precision, features, fused=False)
        kernels.install(model, plan, model.step_linears())
    # the packed copies are all the layers read: one copy of their weights, not two
    panels = kernels.panel_kernels(plan) if model.fused_step is not None else None
    int8 = kernels.int8_kernels(plan) if model.fused_step is not None else None  # (int8 on the kernels' panels)
    if (plan.kernel in ("fbgemm-int8", "onednn") or panels is not None) and not keep_float_weights:
        released = kernels.release_float_weights(model, keep=[model.output_matrix()], panels=panels, int8=int8)
        if panels is None:  # (on panels the output projection keeps its float32 rows: the shortlist's)
            released += release_output_projection(model, int8)
        if released:
            log.info("%s: released %.1f MiB of float weights that packed copies replace", precision, released / 2**20)
    log.info("loaded %s (%d parameters): %s", path, model.num_parameters(), plan.describe())
    return Checkpoint(model, tokenizer, meta, path, plan)


def write_shortlist(
    path: str | Path,
    data_dir: str | Path | None = None,
    per_source: int = shortlist.PER_SOURCE,
    frequent: int = shortlist.FREQUENT,
) -> Path:
    """Build a one-direction checkpoint's shortlist (``shortlist.build``) from the training split
    its config.json names (in ``data_dir``, default the folder named there, relative to the
    working directory) and write it into the folder. -> the file written."""
    path = Path(path)
    meta = read_meta(path)
    if meta.get("target_tags"):
        raise CheckpointError(f"{path}: a many-to-many model has no shortlist (one per direction would be needed)")
    data = meta.get("training", {}).get("config", {}).get("data", {})
    folder = Path(data_dir or data.get("dir", ""))
    source, target, split = meta["source_lang"], meta["target_lang"], data.get("train", "train")
    files = split_file(folder, split, source), split_file(folder, split, target)
    if not all(f.is_file() for f in files):
        raise CheckpointError(f"{files[0]}, {files[1]}: training data not found (pass its folder)")
    cfg, tokenizer = model_config(meta, path), Tokenizer.load(path / SPM)
    pairs = read_parallel(*files)
    table = shortlist.build(
        zip(tokenizer.encode(pairs.src), tokenizer.encode(pairs.tgt), strict=True),
        tokenizer.vocab_size,
        specials=max(cfg.pad_id, cfg.unk_id, cfg.bos_id, cfg.eos_id) + 1,
        per_source=per_source,
        frequent=frequent,
    )
    out = path / shortlist.FILE
    info = {"per_source": str(per_source), "frequent": str(frequent), "pairs": str(len(pairs)), "split": split}
    store = torch.int16 if tokenizer.vocab_size <= torch.iinfo(torch.int16).max else torch.int32
    tensors = {"offsets": table.offsets, "targets": table.targets.to(store), "always": table.always.to(store)}
    save_file(tensors, str(out), metadata=info)
    return out


def load_metadata(file: Path) -> dict[str, str]:
    """A safetensors file's metadata (its header's ``__metadata__``)."""
    with safe_open(str(file), framework="pt") as f:
        return dict(f.metadata() or {})


def load_shortlist(path: str | Path, vocab_size: int) -> Shortlist | None:
    """A checkpoint folder's shortlist, or None where it has none; raises ``CheckpointError``
    for a file that does not match the vocabulary."""
    file = Path(path) / shortlist.FILE
    if not file.is_file():
        return None
    try:
        tensors = load_file(str(file))
        offsets, targets, always = tensors["offsets"].long(), tensors["targets"], tensors["always"].long()
        per_source = int(load_metadata(file)["per_source"])
    except (SafetensorError, KeyError, OSError, ValueError) as err:
        raise CheckpointError(f"{file}: not a shortlist ({err})") from err
    ok = offsets.dim() == targets.dim() == always.dim() == 1 and offsets.numel() == vocab_size + 1
    ok = ok and not targets.is_floating_point() and int(offsets[0]) == 0 and int(offsets[-1]) == targets.numel()
    ok = ok and bool((offsets[1:] >= offsets[:-1]).all())
    if not ok or any(t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size) for t in (targets, always)):
        raise CheckpointError(f"{file}: does not match a vocabulary of {vocab_size} pieces")
    return Shortlist(offsets, targets, always, per_source)


def vocabulary_label(shortlist: Shortlist | None) -> str:
    """What decoding with ``shortlist`` (``use_shortlist``'s answer) scores, as /info,
    ``model.evaluate`` and the benchmarks report it: "shortlist" or "full" (every piece)."""
    return "full" if shortlist is None else "shortlist"


def use_shortlist(ckpt: Checkpoint, wanted: bool = True) -> Shortlist | None:
    """The shortlist decoding will use: the folder's, where ``wanted`` and it pays. int8 decodes
    the whole vocabulary: its output projection (int8 rows on fbgemm) costs less than the
    shortlist's float rows (docs/benchmarks.md "The lexical shortlist": 804 against 706
    sentences/s greedy). Where one is returned, the whole-vocabulary projection leaves the
    decoding path (``shortlist_output``): decoding scores the rows the shortlist gathers from
    the token table, and only the rare teacher-forced pass (``/attention``) projects onto every
    piece. Call before decoding with the model."""
    if not wanted or ckpt.plan.precision == "int8":
        return None
    found = load_shortlist(ckpt.path, ckpt.config.tgt_vocab_size)
    if found is not None:
        released = shortlist_output(ckpt.model)
        if released:
            log.info("%s: the shortlist reads the token table: %.1f MiB of output projection released",
                     ckpt.path, released / 2**20)  # fmt: skip
    return found


def shortlist_output(model: Transformer) -> int:
    """For decoding through a shortlist, a float32 CPU model with tied embeddings keeps its
    output projection once, as the token table the lookups and the shortlist's gathered rows
    read: a packed copy (``release_output_projection``) is freed, the table is stored in
    float16 where that holds every value exactly, and the whole-vocabulary projection converts
    it per call (``kernels.upcast``: slower, for what seldom needs it). Untied models and other
    precisions are left as they are. -> bytes freed (7.8 MiB packed, 3.9 MiB of table, for
    8,000 x 256)."""
    kernel, table = model.kernel, model.output_matrix()
    if model.output is not None or table.is_meta or table.device.type != "cpu":
        return 0
    if isinstance(kernel, kernels.PackedOneDNN):  # its table is float16 already, where exact
        freed = kernel.packed.numel() * kernel.packed.element_size()
    elif kernel is kernels.aten and table.dtype == torch.float32:
        freed = _half_token_tables(model)
    else:
        return 0
    model.kernel = kernels.upcast
    return freed


def _half_token_tables(model: Transformer) -> int:
    """Keep the token tables in float16 where that holds every value exactly (weights shipped in
    float16 do); the lookups upcast the rows they read: the same numbers in half the memory.
    -> bytes released."""
    released = 0
    for tokens in {id(e.tokens): e.tokens for e in (model.src_embed, model.tgt_embed)}.values():
        table = tokens.weight
        if table.dtype != torch.float32 or not torch.equal(table.half().float(), table):
            continue
        released += table.numel() * (table.element_size() - 2)
        tokens.weight = nn.Parameter(table.detach().half(), requires_grad=False)
    return released


def release_output_projection(model: Transformer, int8: ModuleType | None = None) -> int:
    """For inference on packed kernels (after ``kernels.release_float_weights``): the output
    projection runs on a packed copy of its own (``model.kernel``), so its float matrix is read
    by nothing else when untied (released to a placeholder), and only by the token lookups when
    tied to the embeddings. The lookups then keep the embeddings in float16 where that holds
    every value exactly (weights shipped in float16 do), upcast row by row as they are read:
    the same numbers in half the memory (V x D x 2 bytes, 3.9 MiB for 8,000 x 256). ``int8``: the
    fused kernels that take every int8 product (``kernels.int8_kernels``), whose int8 panels then
    hold an int8 projection instead of fbgemm's packed copy.
    -> bytes released."""
    out = model.output_matrix()
    packed = kernels.packed_kernel(model.kernel, out, None, int8=int8)
    if packed is None:
        return 0
    model.kernel = packed
    released = 0
    if model.output is not None:  # untied: the packed copy is its only reader
        released += out.numel() * out.element_size()
        model.output.weight = nn.Parameter(torch.empty_like(out, device="meta"), requires_grad=False)
    return released + _half_token_tables(model)


def load_weights(model: Transformer, path: Path) -> None:
    """Copy tensors from a checkpoint folder's safetensors file (or shards) into ``model`` after
    checking names and shapes."""
    files = weight_files(path)
    if not files:
        raise CheckpointError(f"{path / WEIGHTS}: missing")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(f"{file}: corrupt or not a safetensors file ({err})") from err
    assign(model, tensors, str(files[0] if len(files) == 1 else path))


def assign(model: Transformer, tensors: dict[str, torch.Tensor], where: str = "state") -> None:
    """Copy a (tie-deduplicated) state into ``model``; names and shapes must match exactly."""
    expected = unique_state(model)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: tensors do not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    wrong = [
        f"{k} {tuple(tensors[k].shape)} != {tuple(v.shape)}" for k, v in expected.items() if tensors[k].shape != v.shape
    ]
    if wrong:
        raise CheckpointError(f"{where}: tensor shapes do not match the config: {wrong[:5]}")
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(tensors[name])
