"""A CTranslate2 model folder (``model.bin``, ``config.json``, its vocabularies) read without
CTranslate2, and its ``TransformerSpec`` mapped onto our network.

``model.bin`` is CTranslate2's serialization (``ctranslate2.specs.model_spec.ModelSpec._serialize``,
binary version 6): the spec's name and revision, then each variable (name, shape, dtype, bytes),
then aliases (a name standing for another variable: tied or equal tensors stored once). Quantized
weights (int8, int16) come with a per-row ``weight_scale``: the float weight is q / scale, what
the model's quantization kept; float16 and bfloat16 are widened.

The spec maps onto ours: self-attention ``linear_0`` is our fused ``qkv`` (q, k, v), ``linear_1``
the output; cross-attention ``linear_0`` is ``q``, ``linear_1`` the fused ``kv``, ``linear_2``
the output; each sub-layer's ``layer_norm`` is our residual block's norm, before the sub-layer
(``pre_norm``, with the stacks' final ``layer_norm``) or after the sum; ``scale_embeddings`` is
sqrt(D) or 1; ``position_encodings`` is a stored table; ``projection`` the output (its bias our
output bias). A decoder that starts from a zero embedding (``start_from_zero_embedding``: models
converted from Marian) gets a zero row of its own, its logit at -inf. Anything else (relative
or rotary positions, ALiBi, embedding norms, multi-query attention, other activations) is
refused by name.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.imports import UnsupportedModel

VERSIONS = (5, 6)
DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: None}  # 5: bfloat16
ACTIVATIONS = {0: "relu", 2: "swish", 3: "gelu"}  # ctranslate2.specs.common_spec.Activation
START = "<start>"  # the zero-embedding start piece added for start_from_zero_embedding


def read_variables(file: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """model.bin -> the spec's name and every variable (aliases resolved) as a tensor."""
    data = file.read_bytes()
    offset = 0

    def take(fmt: str) -> Any:
        nonlocal offset
        (value,) = struct.unpack_from(fmt, data, offset)
        offset += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal offset
        n = take("H")
        value = data[offset : offset + n - 1].decode("utf-8")
        offset += n
        return value

    version = take("I")
    if version not in VERSIONS:
        raise UnsupportedModel(f"{file}: CTranslate2 binary version {version} (read: {VERSIONS})")
    name = string()
    take("I")  # the spec's revision
    variables: dict[str, torch.Tensor] = {}
    for _ in range(take("I")):
        key = string()
        shape = [take("I") for _ in range(take("B"))]
        dtype, nbytes = take("B"), take("I")
        raw = data[offset : offset + nbytes]
        offset += nbytes
        if dtype == 5:  # bfloat16: the top half of a float32
            array = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif dtype in DTYPES:
            array = np.frombuffer(raw, DTYPES[dtype])
        else:
            raise UnsupportedModel(f"{file}: {key} has data type {dtype}")
        variables[key] = torch.from_numpy(array.copy()).reshape(shape)
    for _ in range(take("I")):
        alias, target = string(), string()
        variables[alias] = variables[target]
    return name, variables


def vocabularies(folder: Path) -> tuple[list[str], list[str]]:
    """The source and target vocabularies (shared, or one each; JSON lists or lines of text)."""

    def load(stem: str) -> list[str] | None:
        if (folder / f"{stem}.json").is_file():
            return [str(piece) for piece in json.loads((folder / f"{stem}.json").read_text())]
        if (folder / f"{stem}.txt").is_file():
            return (folder / f"{stem}.txt").read_text(encoding="utf-8").rstrip("\n").split("\n")
        return None

    shared = load("shared_vocabulary")
    source, target = load("source_vocabulary"), load("target_vocabulary")
    if shared is not None:
        return shared, shared
    if source is None or target is None:
        raise UnsupportedModel(f"{folder}: no CTranslate2 vocabulary (shared_vocabulary or source_/target_vocabulary)")
    return source, target


@dataclass(frozen=True)
class Spec:
    """A CTranslate2 TransformerSpec's variables, read as floats on demand."""

    variables: dict[str, torch.Tensor]

    def has(self, name: str) -> bool:
        return name in self.variables

    def scalar(self, name: str, default: float | None = None) -> float:
        if name not in self.variables:
            if default is None:
                raise UnsupportedModel(f"the model has no {name}")
            return default
        return float(self.variables[name].reshape(-1)[0])

    def float(self, name: str) -> torch.Tensor:
        """A weight in float32: dequantized with its ``weight_scale`` where it is stored as integers."""
        value = self.variables[name]
        if value.is_floating_point():
            return value.float()
        scale_name = name.rsplit("/", 1)[0] + "/weight_scale"
        if scale_name not in self.variables:
            raise UnsupportedModel(f"{name}: integer weights without a weight_scale")
        scale = self.variables[scale_name].float()
        return value.float() / (scale[:, None] if value.dim() == 2 else scale)

    def linear(self, prefix: str, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A linear layer's weight and bias (zeros where it has none)."""
        weight = self.float(f"{prefix}/weight")
        bias = self.float(f"{prefix}/bias") if self.has(f"{prefix}/bias") else torch.zeros(rows)
        return weight, bias

    def norm(self, prefix: str, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        gamma = self.float(f"{prefix}/gamma")
        beta = self.float(f"{prefix}/beta") if self.has(f"{prefix}/beta") else torch.zeros(d)
        return gamma, beta


def check(spec: Spec, name: str) -> list[str]:
    """What in the spec no ModelConfig option expresses."""
    problems = [] if name == "TransformerSpec" else [f"model type {name} (an encoder-decoder TransformerSpec)"]
    flags = {
        "alibi": "ALiBi positions",
        "multi_query_attention": "multi-query attention",
        "rms_norm": "RMS norm",
        "ffn_glu": "a gated feed-forward (GLU)",
        "parallel_residual": "parallel residuals",
    }
    for scope in ("encoder", "decoder"):
        for flag, what in flags.items():
            if spec.scalar(f"{scope}/{flag}", 0.0):
                problems.append(f"{scope}: {what}")
        if not spec.has(f"{scope}/position_encodings/encodings"):
            problems.append(f"{scope}: no stored position table (relative or rotary positions)")
        if spec.has(f"{scope}/layernorm_embedding/gamma"):
            problems.append(f"{scope}: a layer norm on the embeddings")
        if spec.has(f"{scope}/embeddings_1/weight"):
            problems.append(f"{scope}: source features (several embeddings)")
        activation = int(spec.scalar(f"{scope}/activation", 0))
        if activation not in ACTIVATIONS:
            problems.append(f"{scope}: activation {activation} (supported: ReLU, swish, GELU)")
    for key in ("encoder", "decoder"):
        if any(k.startswith(f"{key}/layer_0/self_attention/relative") for k in spec.variables):
            problems.append(f"{key}: relative position attention")
    if int(spec.scalar("encoder/activation", 0)) != int(spec.scalar("decoder/activation", 0)):
        problems.append("different activations in the encoder and the decoder")
    if spec.scalar("encoder/pre_norm", 1) != spec.scalar("decoder/pre_norm", 1):
        problems.append("pre-LN in one stack and post-LN in the other")
    if spec.scalar("encoder/num_heads") != spec.scalar("decoder/num_heads"):
        problems.append("different head counts in the encoder and the decoder")
    return problems


def embedding_scale(spec: Spec, scope: str, d: int) -> bool:
    """Whether ``scope``'s embeddings are scaled by sqrt(D) (True) or not (False). CTranslate2
    stores a bool (True: sqrt(D)) or the factor itself."""
    name = f"{scope}/scale_embeddings"
    if not spec.has(name):
        return True  # (the spec's default)
    value = spec.variables[name]
    if not value.is_floating_point():
        return bool(value.reshape(-1)[0])
    factor = float(value.reshape(-1)[0])
    if factor == 1.0:
        return False
    if factor == np.float32(math.sqrt(d)):
        return True
    raise UnsupportedModel(f"{scope}: embeddings scaled by {factor} (supported: 1 or sqrt(d_model) = {math.sqrt(d)})")


@dataclass(frozen=True)
class Network:
    """A CTranslate2 model as our network: its config, tensors by our names, the vocabularies (a
    start piece appended to the target's where the decoder starts from zeros) and CTranslate2's
    config.json."""

    config: Any  # ModelConfig (imported inside to keep this module's imports light)
    state: dict[str, torch.Tensor]
    source_vocab: list[str]
    target_vocab: list[str]
    ct2_config: dict[str, Any]


def _special(vocab: list[str], piece: str, what: str) -> int:
    if piece not in vocab:
        raise UnsupportedModel(f"the vocabulary has no {what} piece {piece!r}")
    return vocab.index(piece)


def network(folder: Path) -> Network:
    """Read a CTranslate2 model folder as our network; UnsupportedModel naming what does not map."""
    from model.network.config import ModelConfig

    name, variables = read_variables(folder / "model.bin")
    spec = Spec(variables)
    problems = check(spec, name)
    if problems:
        raise UnsupportedModel("this CTranslate2 model cannot run exactly here: " + "; ".join(problems))
    ct2 = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    source_vocab, target_vocab = vocabularies(folder)
    src_table = spec.float(
        "encoder/embeddings_0/weight" if spec.has("encoder/embeddings_0/weight") else "encoder/embeddings/weight"
    )
    tgt_table, out_table = spec.float("decoder/embeddings/weight"), spec.float("decoder/projection/weight")
    d = tgt_table.shape[1]
    heads = int(spec.scalar("encoder/num_heads"))
    pre = bool(spec.scalar("encoder/pre_norm", 1))
    bias = spec.float("decoder/projection/bias") if spec.has("decoder/projection/bias") else None
    zero_start = bool(spec.scalar("decoder/start_from_zero_embedding", 0))
    if ct2.get("add_source_bos"):
        raise UnsupportedModel("add_source_bos (a BOS before each source)")
    shared = variables_tied(variables) and source_vocab == target_vocab
    if zero_start:  # a start piece of its own: a zero row, never emitted
        target_vocab = [*target_vocab, START]
        tgt_table = torch.cat([tgt_table, tgt_table.new_zeros(1, d)])
        out_table = torch.cat([out_table, out_table.new_zeros(1, d)])
        bias = torch.cat([torch.zeros(out_table.shape[0] - 1) if bias is None else bias, torch.tensor([-math.inf])])
        if shared:
            source_vocab, src_table = target_vocab, tgt_table
    unk = _special(source_vocab, ct2.get("unk_token", "<unk>"), "UNK")
    eos = _special(target_vocab, ct2.get("eos_token", "</s>"), "EOS")
    start = START if zero_start else ct2.get("decoder_start_token") or ct2.get("bos_token", "<s>")
    bos = _special(target_vocab, start, "decoder start")
    pads = [p for p in ("<blank>", "<pad>", START) if p in target_vocab and p in source_vocab]
    if not pads:
        raise UnsupportedModel("no padding piece (<blank>, <pad>) in the vocabulary")
    pad = target_vocab.index(pads[0])
    table = spec.float("encoder/position_encodings/encodings")
    if not torch.equal(table, spec.float("decoder/position_encodings/encodings")):
        raise UnsupportedModel("different position tables in the encoder and the decoder")
    try:
        config = ModelConfig(
            src_vocab_size=len(source_vocab),
            tgt_vocab_size=len(target_vocab),
            d_model=d,
            n_heads=heads,
            encoder_layers=count_layers(variables, "encoder"),
            decoder_layers=count_layers(variables, "decoder"),
            d_ff=spec.float("encoder/layer_0/ffn/linear_0/weight").shape[0],
            dropout=0.0,
            attention_dropout=0.0,
            norm_first=pre,
            positions="learned",
            max_positions=table.shape[0],
            share_embeddings=shared,
            layer_norm_eps=float(ct2.get("layer_norm_epsilon") or 1e-6),
            activation=ACTIVATIONS[int(spec.scalar("encoder/activation", 0))],  # type: ignore[arg-type]
            scale_embeddings=embedding_scale(spec, "encoder", d),
            output_bias=bias is not None,
            source_eos=bool(ct2.get("add_source_eos", False)),
            pad_id=pad,
            unk_id=unk,
            bos_id=bos,
            eos_id=eos,
        )
    except ValueError as err:
        raise UnsupportedModel(str(err)) from err
    if embedding_scale(spec, "decoder", d) != config.scale_embeddings:
        raise UnsupportedModel("embeddings scaled in one stack and not in the other")
    state = {"src_embed.tokens.weight": src_table, "src_embed.learned.weight": table, "tgt_embed.learned.weight": table}
    if not shared:
        state.update({"tgt_embed.tokens.weight": tgt_table, "output.weight": out_table})
    if bias is not None:
        state["output_bias"] = bias
    state.update(_layers(spec, config))
    return Network(config, state, source_vocab, target_vocab, ct2)


def variables_tied(variables: dict[str, torch.Tensor]) -> bool:
    """Whether the source and target embeddings and the projection are one matrix (aliases)."""
    src = variables.get("encoder/embeddings_0/weight", variables.get("encoder/embeddings/weight"))
    tgt, out = variables["decoder/embeddings/weight"], variables["decoder/projection/weight"]
    return src is not None and (src is tgt or torch.equal(src, tgt)) and (tgt is out or torch.equal(tgt, out))


def count_layers(variables: dict[str, torch.Tensor], scope: str) -> int:
    return len({key.split("/")[1] for key in variables if re.match(rf"{scope}/layer_\d+/", key)})


def _layers(spec: Spec, cfg: Any) -> dict[str, torch.Tensor]:
    d, ff = cfg.d_model, cfg.d_ff
    state: dict[str, torch.Tensor] = {}

    def linear(ours: str, theirs: str, rows: int) -> None:
        state[f"{ours}.weight"], state[f"{ours}.bias"] = spec.linear(theirs, rows)

    def norm(ours: str, theirs: str) -> None:
        state[f"{ours}.weight"], state[f"{ours}.bias"] = spec.norm(theirs, d)

    for i in range(cfg.encoder_layers):
        ours, theirs = f"encoder_layers.{i}", f"encoder/layer_{i}"
        linear(f"{ours}.self_attn.qkv", f"{theirs}/self_attention/linear_0", 3 * d)
        linear(f"{ours}.self_attn.out", f"{theirs}/self_attention/linear_1", d)
        norm(f"{ours}.attn_block.norm", f"{theirs}/self_attention/layer_norm")
        linear(f"{ours}.ff.fc1", f"{theirs}/ffn/linear_0", ff)
        linear(f"{ours}.ff.fc2", f"{theirs}/ffn/linear_1", d)
        norm(f"{ours}.ff_block.norm", f"{theirs}/ffn/layer_norm")
    for i in range(cfg.decoder_layers):
        ours, theirs = f"decoder_layers.{i}", f"decoder/layer_{i}"
        linear(f"{ours}.self_attn.qkv", f"{theirs}/self_attention/linear_0", 3 * d)
        linear(f"{ours}.self_attn.out", f"{theirs}/self_attention/linear_1", d)
        norm(f"{ours}.self_block.norm", f"{theirs}/self_attention/layer_norm")
        linear(f"{ours}.cross_attn.q", f"{theirs}/attention/linear_0", d)
        linear(f"{ours}.cross_attn.kv", f"{theirs}/attention/linear_1", 2 * d)
        linear(f"{ours}.cross_attn.out", f"{theirs}/attention/linear_2", d)
        norm(f"{ours}.cross_block.norm", f"{theirs}/attention/layer_norm")
        linear(f"{ours}.ff.fc1", f"{theirs}/ffn/linear_0", ff)
        linear(f"{ours}.ff.fc2", f"{theirs}/ffn/linear_1", d)
        norm(f"{ours}.ff_block.norm", f"{theirs}/ffn/layer_norm")
    if cfg.norm_first:
        norm("encoder_norm", "encoder/layer_norm")
        norm("decoder_norm", "decoder/layer_norm")
    return state
