"""Training on the user's corpora, on one process and on two under ``torchrun`` (DDP, gloo on the
CPU): the two processes step as one process over the same global batches, and a run whose
process was killed resumes to what an unbroken run gives."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model import checkpoint
from model.engine import loading
from model.training.config import load_train_config
from model.training.data import read_lines
from model.training.distributed import Processes
from model.training.stream import StreamedCorpus, scan
from model.training.train import KILL_AT, Trainer, train
from tests.helpers import ROOT

pytestmark = pytest.mark.train

CONFIG = """
name = "corpora"
[data]
dir = "@folder"
source = "de"
target = "en"
eval_limit = 16
bucket = 400
shuffle_buffer = 300
[[data.corpora]]
files = ["{dir}/a.de.gz", "{dir}/a.en.gz"]
[[data.corpora]]
file = "{dir}/b.tsv"
weight = 0.5
[[data.corpora]]
file = "{dir}/val.jsonl"
split = "valid"
[[data.corpora]]
files = ["{dir}/a.de.gz", "{dir}/a.en.gz"]
split = "test"
name = "held-in"
[tokenizer]
vocab_size = 300
[model]
d_model = 32
n_heads = 2
encoder_layers = 1
decoder_layers = 1
d_ff = 64
dropout = @dropout
attention_dropout = @dropout
max_positions = 96
[optim]
max_epochs = @epochs
max_tokens = 500
lr = 3e-3
warmup_steps = 4
bf16 = false
average_count = 1
threads = 1
log_every = 1
"""


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """Multi30k's first pairs as the user's corpora: aligned gzip files, a TSV and a JSONL file."""
    import gzip

    folder = tmp_path_factory.mktemp("corpora")
    de, en = read_lines(data_dir / "train.de.gz")[:1500], read_lines(data_dir / "train.en.gz")[:1500]
    for name, lines in (("a.de.gz", de[:1000]), ("a.en.gz", en[:1000])):
        with gzip.open(folder / name, "wt", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
    (folder / "b.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in zip(de[1000:], en[1000:], strict=True)))
    val_de, val_en = read_lines(data_dir / "val.de.gz")[:16], read_lines(data_dir / "val.en.gz")[:16]
    rows = [json.dumps({"de": s, "en": t}) for s, t in zip(val_de, val_en, strict=True)]
    (folder / "val.jsonl").write_text("\n".join(rows) + "\n")
    return folder


def config(folder: Path, where: Path, epochs: int = 1, dropout: float = 0.0, spm: Path | None = None) -> Path:
    """The corpora's config ("{dir}" in their paths: [data] dir); ``spm``: a tokenizer to use
    instead of training one from the sample."""
    path = where / f"corpora-{epochs}-{dropout}.toml"
    text = CONFIG.replace("@folder", str(folder)).replace("@epochs", str(epochs)).replace("@dropout", str(dropout))
    if spm is not None:
        text = text.replace("vocab_size = 300", f'vocab_size = 300\nmodel = "{spm}"')
    path.write_text(text)
    return path


def torchrun(cfg: Path, out: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node 2 -m model.training.train`` on the CPU (gloo), in a process
    group of its own: its workers go with it should it time out."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "model.training.train", "--config", str(cfg), "--out", str(out), "--device", "cpu", "--no-score"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with subprocess.Popen(
        [*command, *extra], cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as proc:  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def steps_of(run: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]


def test_one_process_trains_on_the_corpora_and_reports_what_cleaning_dropped(tmp_path: Path, corpora: Path) -> None:
    cfg = load_train_config(config(corpora, tmp_path, epochs=1))
    final = train(cfg, tmp_path / "run", device="cpu", max_steps_per_epoch=3)
    report = json.loads((tmp_path / "run" / "data.json").read_text())
    assert report["train"]["a.de.gz"]["read"] == 1000 and report["train"]["b.tsv"]["read"] == 500
    assert report["train"]["b.tsv"]["weight"] == 0.5
    for counts in report["train"].values():
        assert counts["kept"] + sum(counts["dropped"].values()) == counts["read"]
    assert report["valid"] == 16 and report["test"] == {"held-in": 16}
    metrics = json.loads((final / "metrics.json").read_text())
    assert set(metrics) == {"valid", "test:held-in"} and metrics["valid"]["greedy"]["sentences"] == 16
    loaded = loading.load(final)
    assert loaded.meta["source_lang"] == "de" and loaded.meta["training"]["processes"] == 1
    assert loading.load_shortlist(final, loaded.config.tgt_vocab_size) is not None  # from the sample
    assert [s["step"] for s in steps_of(tmp_path / "run")] == [1, 2, 3]


def test_two_processes_step_as_one_over_the_same_global_batches(tmp_path: Path, corpora: Path) -> None:
    """Each process trains on its shard; their gradients averaged by DDP are the gradient of the
    global batch: one process that steps on both processes' batches at once follows the same
    losses and ends with the same weights."""
    path = config(corpora, tmp_path, epochs=1)
    out = torchrun(path, tmp_path / "ddp", "--max-steps-per-epoch", "4")
    assert out.returncode == 0, out.stderr[-4000:]
    ddp_steps = steps_of(tmp_path / "ddp")
    assert [s["step"] for s in ddp_steps] == [1, 2, 3, 4]
    assert json.loads((tmp_path / "ddp" / "data.json").read_text())["processes"] == 2
    assert not (tmp_path / "ddp" / "model" / "metrics.json").exists()
    assert checkpoint.read_meta(tmp_path / "ddp" / "model")["training"]["processes"] == 2

    cfg = load_train_config(path)
    one = Trainer(cfg, tmp_path / "one", torch.device("cpu"), Processes())
    assert one.tokenizer.model_proto == (tmp_path / "ddp" / "spm.model").read_bytes()  # the same sample
    m = cfg.model
    shards = []
    for rank in range(2):
        kept = {i: c.kept for i, c in scan(cfg.data, rank, 2).counts.items()}
        stream = StreamedCorpus(cfg.data, cfg.optim.seed, kept, rank, 2)
        shards.append(stream.batches(0, one._encode, cfg.optim.max_tokens, m.max_positions - 1, (0, 2, 3)))
    one.model.train()
    for expected in ddp_steps:
        group = [next(shards[0]), next(shards[1])]
        tokens = sum(b.target_tokens for b in group)
        loss = float(one.update(group)) / tokens
        assert tokens == expected["tokens"]
        assert loss == pytest.approx(expected["loss"], rel=1e-5)
    weights = load_file(str(tmp_path / "ddp" / "epochs" / "epoch001.safetensors"))
    for name, value in checkpoint.unique_state(one.model).items():
        torch.testing.assert_close(value, weights[name], atol=2e-5, rtol=1e-4)


def test_a_run_killed_in_any_process_resumes_to_the_unbroken_result(tmp_path: Path, corpora: Path) -> None:
    """Three epochs of three updates on two processes, with dropout (each process's RNG is in the
    state): rank 1 killed (SIGKILL) in the second epoch, torchrun ends rank 0, ``--resume``
    continues from the first epoch's state; rank 0 killed in the third, ``--resume`` again from the
    second's; the run ends with the losses and weights of a run never stopped."""
    from model.network.tokenizer import train_tokenizer

    sentences = read_lines(corpora / "a.de.gz") + read_lines(corpora / "a.en.gz")
    (tmp_path / "spm.model").write_bytes(train_tokenizer(sentences, vocab_size=300).model_proto)
    path = config(corpora, tmp_path, epochs=3, dropout=0.1, spm=tmp_path / "spm.model")  # (no tokenizer to train)
    straight = tmp_path / "unbroken"
    out = torchrun(path, straight, "--max-steps-per-epoch", "3")
    assert out.returncode == 0, out.stderr[-4000:]

    run = tmp_path / "killed"
    for killed, step, epochs_done in ((1, 5, [1]), (0, 8, [1, 2])):
        out = torchrun(path, run, "--max-steps-per-epoch", "3", "--resume", env={KILL_AT: f"{killed}:{step}"})
        assert out.returncode != 0 and not (run / "model").exists(), out.stderr[-4000:]
        assert [json.loads(line)["epoch"] for line in (run / "log.jsonl").read_text().splitlines()] == epochs_done
    resumed = torchrun(path, run, "--max-steps-per-epoch", "3", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert steps_of(run) == steps_of(straight)  # (each killed epoch's steps cut from the log on resuming)
    logs = [[json.loads(line) for line in (r / "log.jsonl").read_text().splitlines()] for r in (run, straight)]
    assert [e["train_loss"] for e in logs[0]] == [e["train_loss"] for e in logs[1]]
    a = load_file(str(run / "model" / "model.safetensors"))
    b = load_file(str(straight / "model" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)
