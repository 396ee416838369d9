"""``--init``: a run started from a checkpoint takes its architecture, vocabulary and decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.training.config import load_train_config

CONFIG = """
name = "tuned"
[data]
source = "de"
target = "en"
[tokenizer]
vocab_size = 8000
[optim]
lr = 1e-4
"""


def test_a_run_from_a_checkpoint_keeps_its_architecture_vocabulary_and_decoding(
    tmp_path: Path, tiny_weights_dir: Path
) -> None:
    card = tiny_weights_dir / "de-en"
    meta = json.loads((card / "config.json").read_text())
    path = tmp_path / "tuned.toml"
    path.write_text(CONFIG + "[model]\ndropout = 0.05\n")
    cfg = load_train_config(path, init=card)
    assert cfg.init == str(card)
    assert cfg.model.to_dict() == {**meta["model"], "dropout": 0.05}  # only the dropouts may change
    assert cfg.tokenizer.model == str(card / "spm.model")
    assert cfg.tokenizer.vocab_size == meta["model"]["tgt_vocab_size"] != 8000
    assert cfg.decoding.beam_size == meta["decoding"]["beam_size"] == 2  # the card's, without a [decoding] table
    path.write_text(CONFIG + "[decoding]\nbeam_size = 3\n")
    assert load_train_config(path, init=card).decoding.beam_size == 3
    path.write_text(CONFIG + "[model]\nd_model = 64\n")
    with pytest.raises(ValueError, match="keeps its architecture"):
        load_train_config(path, init=card)
    assert load_train_config(path).init == ""
