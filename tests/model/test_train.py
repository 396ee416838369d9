"""Training: loss goes down, resume continues exactly, checkpoint averaging averages."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import checkpoint
from model.engine import kernels, loading
from model.training.config import load_train_config
from model.training.state import average_files
from model.training.train import Trainer, train

pytestmark = pytest.mark.train

TINY = """
name = "tiny"
[data]
dir = "{data}"
train_limit = 3000
eval_limit = 40
[tokenizer]
vocab_size = 500
[model]
d_model = 32
n_heads = 2
encoder_layers = 1
decoder_layers = 1
d_ff = 64
dropout = 0.1
max_positions = 128
[optim]
max_epochs = {epochs}
max_tokens = 1500
lr = 3e-3
warmup_steps = 10
bf16 = {bf16}
average_count = 2
threads = 1
[decoding]
beam_size = 2
"""


def tiny_config(tmp_path: Path, data_dir: Path, epochs: int, bf16: bool = False) -> Path:
    path = tmp_path / f"tiny{epochs}{'-bf16' if bf16 else ''}.toml"
    path.write_text(TINY.format(data=data_dir, epochs=epochs, bf16=str(bf16).lower()))
    return path


def epochs_of(run: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def test_training_lowers_loss_and_writes_a_checkpoint(tmp_path: Path, data_dir: Path) -> None:
    cfg = load_train_config(tiny_config(tmp_path, data_dir, epochs=2))
    final = train(cfg, tmp_path / "run", max_steps_per_epoch=12)
    log = epochs_of(tmp_path / "run")
    assert [e["epoch"] for e in log] == [1, 2]
    assert log[1]["train_loss"] < log[0]["train_loss"]
    assert log[1]["valid_loss"] < log[0]["valid_loss"]
    assert log[1]["step"] == 24
    loaded = loading.load(final)
    assert loaded.meta["decoding"]["beam_size"] == 2
    metrics = json.loads((final / "metrics.json").read_text())
    assert set(metrics) == {"val", "test_2016_flickr"}
    assert metrics["val"]["greedy"]["sentences"] == 40
    table = loading.load_shortlist(final, loaded.config.tgt_vocab_size)  # built from the training split
    assert table is not None and table.per_source == min(200, loaded.config.tgt_vocab_size)


def test_a_time_budget_stops_before_an_epoch_that_would_overrun_it(tmp_path: Path, data_dir: Path) -> None:
    # a zero budget: the first epoch always runs (nothing to estimate from), no second starts;
    # the run still averages, selects and scores as a finished one
    cfg = load_train_config(tiny_config(tmp_path, data_dir, epochs=3))
    final = train(cfg, tmp_path / "run", max_steps_per_epoch=3, time_budget_s=0.0)
    assert [e["epoch"] for e in epochs_of(tmp_path / "run")] == [1]
    assert loading.load(final).meta["training"]["epochs"] == 1
    assert set(json.loads((final / "metrics.json").read_text())) == {"val", "test_2016_flickr"}
    # a budget far larger than the run changes nothing
    train(cfg, tmp_path / "long", max_steps_per_epoch=3, time_budget_s=3600.0)
    assert [e["epoch"] for e in epochs_of(tmp_path / "long")] == [1, 2, 3]


def test_bf16_autocast_training_and_validation_run_on_cpu(tmp_path: Path, data_dir: Path) -> None:
    """The shipped recipe asks for bf16 autocast: it runs where the CPU has native bf16 (else
    float32, logged), and validation runs under it without gradients."""
    cfg = load_train_config(tiny_config(tmp_path, data_dir, epochs=1, bf16=True))
    assert cfg.optim.bf16
    trainer = Trainer(cfg, tmp_path / "probe", torch.device("cpu"))
    assert trainer.bf16 == (kernels.bf16_autocast("cpu") is None)
    train(cfg, tmp_path / "run", max_steps_per_epoch=4)
    (epoch,) = epochs_of(tmp_path / "run")
    assert epoch["step"] == 4 and math.isfinite(epoch["valid_loss"]) and math.isfinite(epoch["train_loss"])


def test_resume_continues_exactly_where_it_stopped(tmp_path: Path, data_dir: Path) -> None:
    straight = tmp_path / "straight"
    train(load_train_config(tiny_config(tmp_path, data_dir, epochs=2)), straight, max_steps_per_epoch=6)
    interrupted = tmp_path / "interrupted"
    train(load_train_config(tiny_config(tmp_path, data_dir, epochs=1)), interrupted, max_steps_per_epoch=6)
    assert [e["step"] for e in epochs_of(interrupted)] == [6]
    train(load_train_config(tiny_config(tmp_path, data_dir, epochs=2)), interrupted, resume=True, max_steps_per_epoch=6)
    resumed_log, straight_log = epochs_of(interrupted), epochs_of(straight)
    assert [e["step"] for e in resumed_log] == [6, 12]
    assert resumed_log[1]["train_loss"] == straight_log[1]["train_loss"]
    a = load_file(str(interrupted / "epochs" / "epoch002.safetensors"))
    b = load_file(str(straight / "epochs" / "epoch002.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)


def test_average_files_takes_the_elementwise_mean(tmp_path: Path) -> None:
    for i, value in enumerate([1.0, 2.0, 6.0]):
        save_file({"w": torch.full((2, 2), value), "steps": torch.tensor([i])}, str(tmp_path / f"{i}.safetensors"))
    avg = average_files([tmp_path / f"{i}.safetensors" for i in range(3)])
    torch.testing.assert_close(avg["w"], torch.full((2, 2), 3.0))


def test_a_many_to_many_run_trains_every_direction_with_target_tags(tmp_path: Path, data_dir: Path) -> None:
    config = tiny_config(tmp_path, data_dir, epochs=1).read_text()
    config = config.replace("train_limit = 3000", 'train_limit = 600\ndirections = ["de-en", "en-de", "fr-en"]')
    path = tmp_path / "many.toml"
    path.write_text(config.replace("eval_limit = 40", "eval_limit = 12"))
    cfg = load_train_config(path)
    trainer = Trainer(cfg, tmp_path / "many", torch.device("cpu"))
    # every direction's pairs, each source led by its target's tag, which the tokenizer keeps whole
    assert len(trainer.train_text) == sum(len(t) for t in trainer.train_parts.values()) > 3 * 550
    assert [trainer.train_text.src[i].split()[0] for i in (0, 600, 1200)] == ["<2en>", "<2de>", "<2en>"]
    for tag in ("<2de>", "<2en>", "<2fr>"):
        assert tag in trainer.tokenizer.pieces(trainer.tokenizer.encode([f"{tag} Ein Hund."])[0])
    french = trainer.tokenizer.encode(["Un chien court."])[0]
    assert trainer.tokenizer.decode([french]) == ["Un chien court."]  # French is in the joint vocabulary
    final = train(cfg, tmp_path / "many", max_steps_per_epoch=3)
    meta = checkpoint.read_meta(final)
    assert meta["directions"] == ["de-en", "en-de", "fr-en"] and meta["target_tags"] is True
    metrics = json.loads((final / "metrics.json").read_text())
    assert set(metrics) == {"de-en", "en-de", "fr-en"}
    assert all(m["val"]["greedy"]["sentences"] == 12 for m in metrics.values())


def test_directions_must_be_distinct_pairs_of_two_languages(tmp_path: Path, data_dir: Path) -> None:
    for bad in ('["de-en", "de-en"]', '["de"]', '["de-de"]', '["de-en-fr"]'):
        path = tmp_path / "bad.toml"
        path.write_text(tiny_config(tmp_path, data_dir, epochs=1).read_text().replace(
            "train_limit = 3000", f"train_limit = 3000\ndirections = {bad}"))  # fmt: skip
        with pytest.raises(ValueError, match="directions"):
            load_train_config(path).data.pairs()


def test_synthetic_pairs_join_the_training_data_but_not_the_tokenizer(tmp_path: Path, data_dir: Path) -> None:
    """``[data] synthetic``: extra aligned files ("{dir}" is the data folder) are cleaned, cut to
    ``train_limit`` and trained on after the real pairs; the vocabulary is learnt from the real
    pairs alone."""
    from model.training.data import read_lines

    german, english = read_lines(data_dir / "train.de.gz"), read_lines(data_dir / "train.en.gz")
    (tmp_path / "synthetic.en").write_text("".join(f"Synthetic: {line}\n" for line in english))
    config = tiny_config(tmp_path, data_dir, epochs=1).read_text().replace("train_limit = 3000", "train_limit = 300")
    plain = tmp_path / "plain.toml"
    plain.write_text(config)
    path = tmp_path / "synthetic.toml"
    pair = f'["{{dir}}/train.de.gz", "{tmp_path / "synthetic.en"}"]'
    path.write_text(config.replace("train_limit = 300", f"train_limit = 300\nsynthetic = [{pair}]"))
    cfg = load_train_config(path)
    assert cfg.data.synthetic_files() == [(f"{data_dir}/train.de.gz", str(tmp_path / "synthetic.en"))]
    with_synthetic = Trainer(cfg, tmp_path / "with", torch.device("cpu"))
    without = Trainer(load_train_config(plain), tmp_path / "without", torch.device("cpu"))
    assert with_synthetic.synthetic.src == german[:300]
    assert with_synthetic.synthetic.tgt == [f"Synthetic: {line}" for line in english[:300]]
    assert len(with_synthetic.train_data.src_ids) == len(without.train_data.src_ids) + 300
    assert (tmp_path / "with" / "spm.model").read_bytes() == (tmp_path / "without" / "spm.model").read_bytes()
    final = train(cfg, tmp_path / "with", max_steps_per_epoch=3)
    assert checkpoint.read_meta(final)["training"]["config"]["data"]["synthetic"] == [
        ["{dir}/train.de.gz", str(tmp_path / "synthetic.en")]
    ]


def test_synthetic_entries_are_file_pairs_for_one_direction_runs(tmp_path: Path, data_dir: Path) -> None:
    config = tiny_config(tmp_path, data_dir, epochs=1).read_text()
    for bad in ('[["a.en"]]', '[["a.en", ""]]', '["a.en", "b.de"]'):
        path = tmp_path / "bad.toml"
        path.write_text(config.replace("train_limit = 3000", f"train_limit = 3000\nsynthetic = {bad}"))
        with pytest.raises(ValueError, match="synthetic"):
            load_train_config(path)
    path.write_text(config.replace("train_limit = 3000", 'synthetic = [["a", "b"]]\ndirections = ["de-en", "en-de"]'))
    with pytest.raises(ValueError, match="one-direction"):
        load_train_config(path)


def test_subword_sampling_segments_the_training_pairs_anew_each_epoch_and_resumes_alike(
    tmp_path: Path, data_dir: Path
) -> None:
    text = TINY.format(data=data_dir, epochs="{epochs}", bf16="false").replace(
        "vocab_size = 500", "vocab_size = 500\nsampling_alpha = 0.3"
    )
    configs = {}
    for epochs in (1, 2):
        configs[epochs] = tmp_path / f"sampled{epochs}.toml"
        configs[epochs].write_text(text.replace("{epochs}", str(epochs)))
    trainer = Trainer(load_train_config(configs[2]), tmp_path / "probe", torch.device("cpu"))
    best = trainer.tokenizer.encode(trainer.train_all.src)
    drawn = []
    for epoch in (0, 1, 0):
        trainer.epoch = epoch
        drawn.append(trainer._sampled_corpus())
    assert drawn[0].src_ids == drawn[2].src_ids and drawn[0].tgt_ids == drawn[2].tgt_ids  # the epoch's seed
    assert drawn[0].src_ids != drawn[1].src_ids and drawn[0].tgt_ids != drawn[1].tgt_ids
    assert drawn[0].src_ids != best and trainer.tokenizer.decode(drawn[0].src_ids) == trainer.tokenizer.decode(best)
    assert trainer.valid_data.src_ids == trainer.tokenizer.encode(trainer.valid_text.src)  # never sampled

    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    train(load_train_config(configs[2]), straight, max_steps_per_epoch=4)
    train(load_train_config(configs[1]), interrupted, max_steps_per_epoch=4)
    train(load_train_config(configs[2]), interrupted, resume=True, max_steps_per_epoch=4)
    assert epochs_of(interrupted)[1]["train_loss"] == epochs_of(straight)[1]["train_loss"]


def test_sampling_settings_are_checked() -> None:
    from model.training.config import TokenizerConfig

    with pytest.raises(ValueError, match="sampling_alpha"):
        TokenizerConfig(sampling_alpha=1.5)
    with pytest.raises(ValueError, match="sampling_nbest"):
        TokenizerConfig(sampling_alpha=0.2, sampling_nbest=1)
    with pytest.raises(ValueError, match="unigram"):
        TokenizerConfig(model_type="bpe", sampling_alpha=0.2)


def test_a_named_tokenizer_model_is_used_as_it_is(tmp_path: Path, data_dir: Path) -> None:
    """[tokenizer] model: the run reads that sentencepiece file instead of training one (how a
    config reproduces shipped weights whatever sentencepiece version trains here)."""
    from model.network.tokenizer import train_tokenizer
    from model.training.data import read_lines

    sentences = read_lines(data_dir / "train.de.gz")[-800:] + read_lines(data_dir / "train.en.gz")[-800:]
    other = train_tokenizer(sentences, vocab_size=400)
    (tmp_path / "given.model").write_bytes(other.model_proto)
    text = TINY.format(data=data_dir, epochs=1, bf16="false")
    config = tmp_path / "given.toml"
    config.write_text(text.replace("vocab_size = 500", f'vocab_size = 400\nmodel = "{tmp_path / "given.model"}"'))
    trainer = Trainer(load_train_config(config), tmp_path / "run", torch.device("cpu"))
    assert trainer.tokenizer.model_proto == other.model_proto
    assert (tmp_path / "run" / "spm.model").read_bytes() == other.model_proto
    config.write_text(text.replace("vocab_size = 500", f'vocab_size = 500\nmodel = "{tmp_path / "given.model"}"'))
    with pytest.raises(ValueError, match="has 400 pieces"):
        Trainer(load_train_config(config), tmp_path / "mismatch", torch.device("cpu"))


@pytest.mark.parametrize("config", sorted((Path(__file__).parents[2] / "configs").glob("*.toml")), ids=lambda p: p.stem)
def test_each_shipped_config_reads_its_weights_vocabulary(config: Path) -> None:
    from model.network.tokenizer import Tokenizer, target_prefix

    cfg = load_train_config(config)
    root = Path(__file__).parents[2]
    assert cfg.tokenizer.model == f"weights/{config.stem}/spm.model"
    tokenizer = Tokenizer.load(root / cfg.tokenizer.model)
    assert tokenizer.vocab_size == cfg.tokenizer.vocab_size == cfg.model.tgt_vocab_size
    for _source, target in cfg.data.pairs() if cfg.data.directions else []:
        assert target_prefix(tokenizer, target)


def test_no_score_writes_the_model_without_scoring_it(tmp_path: Path, data_dir: Path) -> None:
    from model.training.train import main

    config = tiny_config(tmp_path, data_dir, epochs=1)
    main(["--config", str(config), "--out", str(tmp_path / "run"), "--max-steps-per-epoch", "2", "--no-score"])
    final = tmp_path / "run" / "model"
    loaded = loading.load(final)
    assert loaded.meta["training"]["epochs"] == 1
    assert loading.load_shortlist(final, loaded.config.tgt_vocab_size) is not None  # still built
    assert not (final / "metrics.json").exists()
    # scored by a later run of the same folder, unscored again without leaving the old scores
    main(["--config", str(config), "--out", str(tmp_path / "run"), "--max-steps-per-epoch", "2", "--resume"])
    assert (final / "metrics.json").exists()
    main(["--config", str(config), "--out", str(tmp_path / "run"), "--resume", "--no-score"])
    assert not (final / "metrics.json").exists()
