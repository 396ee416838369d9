"""Network structure, masks and attention maps."""

from __future__ import annotations

import pytest
import torch

from model.network.config import ModelConfig
from model.network.masks import causal_mask, padding_mask
from model.network.transformer import Transformer, sinusoidal_table
from tests.factories import make_model


def test_masks_follow_the_true_means_attend_convention() -> None:
    ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    assert padding_mask(ids, 0).tolist() == [[[[True, True, False]]], [[[True, False, False]]]]
    assert causal_mask(3)[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_attention_maps_shapes_rows_and_padding() -> None:
    model = make_model()
    src = torch.tensor([[5, 6, 7, 3, 0, 0], [8, 9, 10, 11, 12, 3]])
    tgt = torch.tensor([[2, 14, 15, 16], [2, 17, 18, 19]])
    logits, maps = model.attention_maps(src, tgt)
    cfg = model.config
    assert maps.encoder.shape == (cfg.encoder_layers, 2, cfg.n_heads, 6, 6)
    assert maps.decoder.shape == (cfg.decoder_layers, 2, cfg.n_heads, 4, 4)
    assert maps.cross.shape == (cfg.decoder_layers, 2, cfg.n_heads, 4, 6)
    for m in (maps.encoder, maps.decoder, maps.cross):
        torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1]))
    # padded source keys get exactly zero weight, in encoder and cross attention
    assert maps.encoder[:, 0, :, :, 4:].abs().max() == 0
    assert maps.cross[:, 0, :, :, 4:].abs().max() == 0
    # decoder self-attention is causal
    assert torch.triu(maps.decoder, diagonal=1).abs().max() == 0
    # weights on do not change the output
    torch.testing.assert_close(logits, model(src, tgt))


def test_shared_embeddings_are_one_matrix() -> None:
    shared = make_model(share_embeddings=True)
    separate = make_model(share_embeddings=False)
    assert shared.src_embed.tokens.weight is shared.tgt_embed.tokens.weight
    assert shared.output is None
    extra = 2 * shared.config.tgt_vocab_size * shared.config.d_model  # target embedding + output projection
    assert separate.num_parameters() - shared.num_parameters() == extra


def test_embedding_scale_and_sinusoids() -> None:
    table = sinusoidal_table(10, 8)
    assert table.shape == (10, 8)
    assert table[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # sin(0) | cos(0)
    assert torch.allclose(table[3, 0], torch.sin(torch.tensor(3.0)))


def test_encoder_and_decoder_read_one_position_table() -> None:
    """The sinusoidal table is one buffer for both embeddings (the same values), kept shared by
    a move to the CPU in float32; learned positions have none."""
    model = make_model().to("cpu", torch.float32)
    assert model.src_embed.table is not None and model.src_embed.table is model.tgt_embed.table
    assert make_model(positions="learned").tgt_embed.table is None


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(100, 100, d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="joint vocabulary"):
        ModelConfig(100, 200, share_embeddings=True)
    with pytest.raises(ValueError, match="unknown"):
        ModelConfig.from_dict({"src_vocab_size": 10, "tgt_vocab_size": 10, "d_modle": 8})


def test_too_long_input_is_an_error_not_a_truncation() -> None:
    model = make_model(max_positions=8)
    with pytest.raises(ValueError, match="max_positions"):
        model.encode(torch.randint(4, 50, (1, 9)))


def test_xavier_init_and_zero_pad_embedding() -> None:
    model = Transformer(ModelConfig(50, 50, d_model=32, n_heads=4, d_ff=64))
    assert model.src_embed.tokens.weight[0].abs().max() == 0
    w = model.encoder_layers[0].ff.fc1.weight
    bound = (6 / (w.shape[0] + w.shape[1])) ** 0.5
    assert w.abs().max() <= bound
