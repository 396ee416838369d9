"""Train a translation model from a TOML config.

    python -m model.training.train --config configs/de-en.toml [--out DIR] [--resume] [--device D] [--no-score]
    python -m model.training.train --config my-corrections.toml --init weights/de-en   # fine-tune a checkpoint
    torchrun --nproc-per-node N -m model.training.train --config ...   # N processes (DDP), same config

Each epoch: training with label-smoothed cross entropy, then validation loss and greedy
validation BLEU, an epoch checkpoint, a JSONL log line and the resumable state. At the end:
checkpoint averaging, selection on validation BLEU, and the final checkpoint folder
(``OUT/model``) with its scores in ``metrics.json``. A config with ``[data] directions``
trains one many-to-many model on all of them (``Trainer.many``: target tags on the source side).
A config with ``[[data.corpora]]`` trains on the user's own corpora, streamed from disk
(``model.training.stream``). Under ``torchrun`` each process trains on its shard of the data and
rank 0 alone validates and writes the run folder (``model.training.distributed``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import signal
import time
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from model import checkpoint
from model.engine import kernels
from model.engine.options import DecodingOptions
from model.engine.translator import Translator
from model.network.tokenizer import Tokenizer, target_prefix, target_tag, train_tokenizer
from model.network.transformer import Transformer
from model.training import shortlists
from model.training.config import TrainConfig, load_train_config
from model.training.data import Batch, Parallel, TokenizedCorpus, clean, concat, read_parallel, split_file
from model.training.distributed import Processes
from model.training.evaluate import measure_checkpoint, measure_sets, score_translations
from model.training.multi30k import ensure_split_files
from model.training.progress import progress
from model.training.state import apply_state, average_files, read_state, rng_state, save_state
from model.training.stream import StreamedCorpus, merge_scans, read_corpus, scan

log = logging.getLogger(__name__)

KILL_AT = "TRANSLATOR_TRAIN_KILL_AT"


def inverse_sqrt_schedule(warmup: int) -> Any:
    """Linear warmup to the peak, then decay with 1/sqrt(step) (the paper's schedule)."""

    def factor(step: int) -> float:
        step = max(step, 1)
        return min(step / warmup, math.sqrt(warmup / step))

    return factor


def smoothed_loss(logits: torch.Tensor, target: torch.Tensor, epsilon: float, pad_id: int) -> torch.Tensor:
    """Summed label-smoothed cross entropy over non-pad targets. logits (B, T, V), target (B, T)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), target.flatten(), ignore_index=pad_id, label_smoothing=epsilon, reduction="sum"
    )


def resolve_device(name: str, processes: Processes | None = None) -> torch.device:
    """ "auto": a GPU where there is one, else the CPU; under torchrun "cuda" (or "auto" with
    GPUs) is the process's own GPU, cuda:LOCAL_RANK."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if processes is not None and processes.many and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", processes.local)
    return device


@dataclass(frozen=True)
class EpochRecord:
    epoch: int
    step: int
    train_loss: float
    valid_loss: float
    valid_bleu: float
    lr: float
    tokens_per_s: float
    seconds: float


class Trainer:
    """Owns the data, model, optimizer and the run folder of one training run (of this process,
    one of ``processes``; rank 0 alone writes the run folder)."""

    def __init__(self, cfg: TrainConfig, out: Path, device: torch.device, processes: Processes | None = None) -> None:
        self.cfg, self.out, self.device = cfg, out, device
        self.procs = processes or Processes()
        self.procs.start(device)
        if self.procs.main:
            out.mkdir(parents=True, exist_ok=True)
        if cfg.optim.threads:
            torch.set_num_threads(cfg.optim.threads)
        torch.manual_seed(cfg.optim.seed)
        d = cfg.data
        self.pairs = d.pairs()
        self.languages = sorted({lang for pair in self.pairs for lang in pair})
        self.stream: StreamedCorpus | None = None
        self.sample = Parallel([], [])  # streamed corpora: the pairs the tokenizer and shortlist learn from
        self.test_text: dict[str, Parallel] = {}  # streamed corpora: the test corpora, scored at the end
        if d.corpora:
            self.data_dir = d.dir
            self._read_corpora()
        else:
            # the configured folder, or Multi30k downloaded and verified when it is not there
            # (rank 0 first, so that processes sharing a folder do not download it at once)
            if self.procs.main:
                self.data_dir = str(ensure_split_files(d.dir, [d.train, d.valid, d.test], self.languages))
            self.procs.barrier()
            if not self.procs.main:
                self.data_dir = str(ensure_split_files(d.dir, [d.train, d.valid, d.test], self.languages))
            # per direction, untagged; a many-to-many run leads each source with its target's tag
            self.train_parts = {p: clean(self._read(d.train, p), d.max_ratio).head(d.train_limit) for p in self.pairs}
            self.valid_parts = {p: self._read(d.valid, p).head(d.eval_limit) for p in self.pairs}
            self.train_text = self._joined(self.train_parts)
            self.valid_text = self._joined(self.valid_parts)
        self.tokenizer = self._shared_tokenizer()  # from [train] alone, never from synthetic text
        if not d.corpora:
            self.synthetic = self._synthetic()
            self.train_all = self._shard(concat([self.train_text, self.synthetic]))
            self.train_data = self._corpus(self.train_all)
        self.valid_data = self._corpus(self.valid_text)
        self.model = Transformer(cfg.model).to(device)
        if self.procs.many:  # the same initial weights everywhere (DDP sends rank 0's anyway), each its own dropout
            torch.manual_seed(cfg.optim.seed * 100_003 + 7 * self.procs.rank + 1)
        if cfg.init:  # fine-tuning: the checkpoint's weights (a resumed run's state replaces them)
            checkpoint.load_weights(self.model, Path(cfg.init))
            log.info("initialised from %s", cfg.init)
        self.ddp: torch.nn.parallel.DistributedDataParallel | None = None  # (run: once the state is in place)
        slow = kernels.bf16_autocast(device) if cfg.optim.bf16 else None
        if slow:
            log.warning("bf16 = true in the config, but %s: training in float32", slow)
        self.bf16 = cfg.optim.bf16 and slow is None
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, inverse_sqrt_schedule(o.warmup_steps))
        self.step, self.epoch = 0, 0
        self.history: list[dict[str, Any]] = []  # EpochRecord dicts
        # fault injection for the tests of --resume: "RANK:STEP" kills that process (SIGKILL, as
        # the kernel's OOM killer or a preempted machine would) right after that update
        at = os.environ.get(KILL_AT, "")
        self.kill_at = tuple(int(x) for x in at.split(":")) if at else None

    def _read(self, split: str, pair: tuple[str, str]) -> Parallel:
        return read_parallel(split_file(self.data_dir, split, pair[0]), split_file(self.data_dir, split, pair[1]))

    def _read_corpora(self) -> None:
        """[[data.corpora]]: one read of this process's shard of the training corpora (what
        cleaning dropped, the sample), every process's counts summed into the run's data.json;
        the validation and test corpora read whole."""
        d, procs = self.cfg.data, self.procs
        mine = scan(d, procs.rank, procs.world)
        kept = {index: c.kept for index, c in mine.counts.items()}
        self.stream = StreamedCorpus(d, self.cfg.optim.seed, kept, procs.rank, procs.world)
        self.valid_parts = {self.pairs[0]: concat(read_corpus(c, d) for c in d.corpora_of("valid")).head(d.eval_limit)}
        self.valid_text = self.valid_parts[self.pairs[0]]
        self.train_parts = {}
        self.test_text = {c.label: read_corpus(c, d).head(d.eval_limit) for c in d.corpora_of("test")}
        scans = procs.gather_to_main(mine)  # (samples too: each at most sample_pairs)
        if scans is None:  # not rank 0: the sample and the report are rank 0's
            return
        whole = merge_scans(scans, d.sample_pairs)
        self.sample = Parallel([p.src for p in whole.sample], [p.tgt for p in whole.sample])
        train = {d.corpora[i].label: {**c.as_dict(), "weight": d.corpora[i].weight} for i, c in whole.counts.items()}
        for name, c in train.items():
            log.info("corpus %s: %d of %d rows kept, dropped %s", name, c["kept"], c["read"], c["dropped"])
        report = {
            "train": train,
            "valid": len(self.valid_text),
            "test": {name: len(text) for name, text in self.test_text.items()},
            "processes": procs.world,
        }
        if not any(c["kept"] for c in train.values()):
            raise ValueError("[data] corpora: no training pair left after cleaning")
        (self.out / "data.json").write_text(json.dumps(report, indent=2) + "\n")

    def _shard(self, text: Parallel) -> Parallel:
        """This process's pairs of an in-memory corpus: every ``world``-th from its rank on."""
        if not self.procs.many:
            return text
        r, n = self.procs.rank, self.procs.world
        return Parallel(text.src[r::n], text.tgt[r::n])

    def _synthetic(self) -> Parallel:
        """``data.synthetic``'s pairs, cleaned like [train] (``train_limit`` applies to each file)."""
        d = self.cfg.data
        parts = []
        for source, target in d.synthetic_files():
            parts.append(clean(read_parallel(source, target), d.max_ratio).head(d.train_limit))
            log.info("synthetic pairs: %d from %s | %s", len(parts[-1]), source, target)
        return concat(parts)

    @property
    def many(self) -> bool:
        """A many-to-many run (``data.directions``): target tags on the source side."""
        return bool(self.cfg.data.directions)

    def _tagged(self, pair: tuple[str, str], text: Parallel) -> Parallel:
        if not self.many:
            return text
        return Parallel([f"{target_tag(pair[1])} {line}" for line in text.src], text.tgt)

    def _joined(self, parts: dict[tuple[str, str], Parallel]) -> Parallel:
        return concat(self._tagged(pair, text) for pair, text in parts.items())

    def _shared_tokenizer(self) -> Tokenizer:
        """Rank 0's tokenizer (``_tokenizer``), in every process."""
        proto = self._tokenizer().model_proto if self.procs.main else b""
        return Tokenizer(self.procs.broadcast(proto)) if self.procs.many else Tokenizer(proto)

    def _tokenizer(self) -> Tokenizer:
        spm_path = self.out / checkpoint.SPM
        if spm_path.exists():
            return Tokenizer.load(spm_path)
        t = self.cfg.tokenizer
        if t.model:
            tokenizer = Tokenizer.load(t.model)
            if tokenizer.vocab_size != t.vocab_size:
                raise ValueError(
                    f"[tokenizer] model {t.model} has {tokenizer.vocab_size} pieces, vocab_size says {t.vocab_size}"
                )
            for lang in self.languages if self.many else []:
                target_prefix(tokenizer, lang)  # a many-to-many run's tags are pieces of it
            spm_path.write_bytes(tokenizer.model_proto)
            return tokenizer
        if self.many:  # each language's sentences once, however many directions they appear in
            corpus = list(dict.fromkeys(x for text in self.train_parts.values() for x in text.src + text.tgt))
            tags = [target_tag(lang) for lang in self.languages]
        elif self.cfg.data.corpora:
            corpus, tags = self.sample.src + self.sample.tgt, []
        else:
            corpus, tags = self.train_text.src + self.train_text.tgt, []
        tokenizer = train_tokenizer(corpus, t.vocab_size, t.model_type, t.character_coverage, user_symbols=tags)
        spm_path.write_bytes(tokenizer.model_proto)
        return tokenizer

    def _corpus(self, text: Parallel) -> TokenizedCorpus:
        m = self.cfg.model
        return TokenizedCorpus(
            self.tokenizer.encode(text.src), self.tokenizer.encode(text.tgt), m.pad_id, m.bos_id, m.eos_id
        )

    def _sampled_corpus(self) -> TokenizedCorpus:
        """The training pairs segmented by sampling (subword regularization), drawn anew each
        epoch from a seed of the run's and the epoch's, so a resumed run draws the same."""
        t, m = self.cfg.tokenizer, self.cfg.model
        seed = self.cfg.optim.seed * 100_003 + self.epoch
        sample = self.tokenizer.sample
        src = sample(self.train_all.src, t.sampling_alpha, t.sampling_nbest, seed)
        tgt = sample(self.train_all.tgt, t.sampling_alpha, t.sampling_nbest, seed + 50_000)
        return TokenizedCorpus(src, tgt, m.pad_id, m.bos_id, m.eos_id)

    def _encode(self, texts: list[str], seed: int) -> list[list[int]]:
        """Streamed corpora's tokenization: sampled segmentations (seeded) when the config asks."""
        t = self.cfg.tokenizer
        if t.sampling_alpha:
            return self.tokenizer.sample(texts, t.sampling_alpha, t.sampling_nbest, seed)
        return self.tokenizer.encode(texts)

    def epoch_batches(self) -> Iterable[Batch]:
        """This process's training batches of the current epoch (a list for in-memory corpora)."""
        o, m = self.cfg.optim, self.cfg.model
        if self.stream is not None:
            longest = m.max_positions - 1  # a side's pieces, with its BOS or EOS
            specials = (m.pad_id, m.bos_id, m.eos_id)
            return self.stream.batches(self.epoch, self._encode, o.max_tokens, longest, specials)
        if self.cfg.tokenizer.sampling_alpha:
            self.train_data = self._sampled_corpus()
        return list(self.train_data.batches(o.max_tokens, shuffle=True, seed=o.seed + self.epoch))

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def _loss(self, batch: Batch, module: torch.nn.Module | None = None) -> torch.Tensor:
        src, tgt_in, tgt_out = (t.to(self.device, non_blocking=True) for t in (batch.src, batch.tgt_in, batch.tgt_out))
        with self._autocast():
            logits = (module or self.model)(src, tgt_in)
        return smoothed_loss(logits, tgt_out, self.cfg.optim.label_smoothing, self.cfg.model.pad_id)

    def update(self, group: list[Batch], tokens: int | None = None) -> torch.Tensor:
        """One optimizer step on ``group``, this process's part of a global batch of ``tokens``
        target tokens (default: the group's own); -> the group's summed loss (on the device).
        Each process's gradients are scaled so that their mean, which DDP takes, is the gradient
        of the global batch's loss per token: N processes step as one would over their groups."""
        o = self.cfg.optim
        tokens = tokens if tokens is not None else sum(b.target_tokens for b in group)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, batch in enumerate(group):
            last = i == len(group) - 1  # DDP averages the gradients once, after the group's last backward
            with nullcontext() if self.ddp is None or last else self.ddp.no_sync():
                loss = self._loss(batch, self.ddp)
                (loss / tokens if self.ddp is None else loss * (self.procs.world / tokens)).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), o.clip_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return total

    def _groups(self, batches: Iterable[Batch], max_steps: int | None) -> Iterator[list[Batch]]:
        """``accumulate`` batches at a time (the last group may be short); an empty group at the end."""
        it = iter(batches)
        for _ in range(max_steps) if max_steps is not None else itertools.count():
            group = list(itertools.islice(it, self.cfg.optim.accumulate))
            yield group
            if not group:
                return
        yield []

    def train_epoch(self, max_steps: int | None = None) -> tuple[float, float]:
        """One pass over the training data -> (loss per token, target tokens per second), over
        every process. Processes hold different numbers of batches: the epoch ends for all at the
        first update that one of them has no batch for."""
        o = self.cfg.optim
        self.model.train()
        # the summed loss stays on the device: reading it each step would make the host wait for
        # the device before queueing the next step (only a visible progress bar reads it, now and then)
        total_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        total_tokens, start = 0, time.perf_counter()
        batches = self.epoch_batches()
        total = math.ceil(len(batches) / o.accumulate) if isinstance(batches, list) else None
        if total is not None and max_steps is not None:
            total = min(total, max_steps)
        bar = tqdm(desc=f"epoch {self.epoch + 1}", total=total, unit="step", mininterval=2.0, leave=False,
                   disable=None if self.procs.main else True)  # fmt: skip
        for group in self._groups(batches, max_steps):
            tokens = sum(b.target_tokens for b in group)
            if self.procs.many:  # the global batch's tokens, and whether any process ran out
                tokens_f, missing = self.procs.sum([float(tokens), float(not group)])
                if missing:
                    break
                tokens = int(tokens_f)
            elif not group:
                break
            loss = self.update(group, tokens)
            if self.kill_at == (self.procs.rank, self.step):
                os.kill(os.getpid(), signal.SIGKILL)
            total_loss += loss
            total_tokens += tokens
            bar.update()
            if o.log_every and self.step % o.log_every == 0:
                self._log_step(loss, tokens)
            if not bar.disable and self.step % 50 == 0:
                bar.set_postfix(
                    loss=f"{float(total_loss) / total_tokens:.3f}",
                    lr=f"{self.scheduler.get_last_lr()[0]:.2e}",
                    tok_s=f"{total_tokens / (time.perf_counter() - start):.0f}",
                )
        bar.close()
        if self.procs.many:
            (summed,) = self.procs.sum([float(total_loss)])
            mean_loss = summed / max(total_tokens, 1)  # total_tokens: already global
        else:
            mean_loss = float(total_loss) / max(total_tokens, 1)  # waits for the epoch's last step
        if self.stream is not None and self.stream.too_long:
            log.info("%d pairs longer than the model's %d positions left out", self.stream.too_long,
                     self.cfg.model.max_positions)  # fmt: skip
        return mean_loss, total_tokens / (time.perf_counter() - start)

    def _log_step(self, loss: torch.Tensor, tokens: int) -> None:
        """OUT/steps.jsonl (``optim.log_every``): this update's loss per target token, over every process."""
        (summed,) = self.procs.sum([float(loss)])
        if self.procs.main:
            record = {"step": self.step, "epoch": self.epoch + 1, "loss": summed / tokens, "tokens": tokens,
                      "lr": float(self.scheduler.get_last_lr()[0])}  # fmt: skip
            with (self.out / "steps.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")

    @torch.no_grad()
    def validate(self) -> tuple[float, float]:
        """-> (validation loss per token, greedy validation BLEU; a many-to-many run's is the
        mean over its directions)."""
        self.model.eval()
        total, tokens = 0.0, 0
        for batch in self.valid_data.batches(self.cfg.optim.max_tokens, shuffle=False):
            total += float(self._loss(batch))
            tokens += batch.target_tokens
        with progress(len(self.valid_text.src), "validation BLEU (greedy)") as bar:
            hyps = Translator(self.model, self.tokenizer).translate(
                self.valid_text.src, DecodingOptions(beam_size=1), on_done=bar.update
            )
        scores, start = {}, 0
        for (source, target), text in self.valid_parts.items():
            end = start + len(text)
            scores[f"{source}-{target}"] = score_translations([h.text for h in hyps[start:end]], text.tgt)["bleu"]
            start = end
        if self.many:
            log.info("validation BLEU (greedy) per direction: %s", scores)
        return total / tokens, sum(scores.values()) / len(scores)

    def _wrap(self) -> None:
        """Several processes: DDP around the model, once the weights are in place (it starts by
        giving every process rank 0's)."""
        if self.procs.many and self.ddp is None:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)

    def run(self, max_steps_per_epoch: int | None = None, time_budget_s: float | None = None) -> None:
        """Train until ``max_epochs``, patience, or (when given) the time budget: no epoch starts
        that the last one's duration says would end past ``time_budget_s`` from now. Rank 0
        validates and decides; every process gets its record, so all stop together."""
        o = self.cfg.optim
        self._wrap()
        started = time.perf_counter()
        while self.epoch < o.max_epochs and not self._patience_exhausted():
            if time_budget_s is not None and self.history:
                elapsed = time.perf_counter() - started
                if self.procs.broadcast(elapsed + self.history[-1]["seconds"] > time_budget_s):
                    log.info(
                        "time budget %.0f s: stopping after epoch %d (%.0f s used)", time_budget_s, self.epoch, elapsed
                    )
                    break
            t0 = time.perf_counter()
            train_loss, rate = self.train_epoch(max_steps_per_epoch)
            valid_loss, bleu = self.validate() if self.procs.main else (0.0, 0.0)
            self.epoch += 1
            record = EpochRecord(
                self.epoch,
                self.step,
                train_loss,
                valid_loss,
                bleu,
                float(self.scheduler.get_last_lr()[0]),
                rate,
                time.perf_counter() - t0,
            )
            self.history.append(self.procs.broadcast(record.__dict__))
            self._save_epoch()
            if self.procs.main:
                with (self.out / "log.jsonl").open("a") as f:
                    f.write(json.dumps(record.__dict__) + "\n")
            log.info(
                "epoch %d step %d train %.3f valid %.3f bleu %.2f (%.0f tok/s, %.0fs)",
                self.epoch,
                self.step,
                train_loss,
                valid_loss,
                bleu,
                rate,
                record.seconds,
            )

    def _patience_exhausted(self) -> bool:
        if not self.history:
            return False
        best = max(range(len(self.history)), key=lambda i: self.history[i]["valid_bleu"])
        return len(self.history) - 1 - best >= self.cfg.optim.patience

    def _save_epoch(self) -> None:
        """Rank 0: the epoch's weights, the resumable state (every process's RNG in it), then
        epoch files no longer needed go; every process takes part (the RNG states)."""
        rng = self.procs.gather(rng_state())
        if not self.procs.main:
            return
        epochs = self.out / "epochs"
        epochs.mkdir(exist_ok=True)
        save_file(checkpoint.unique_state(self.model), str(epochs / f"epoch{self.epoch:03d}.safetensors"))
        scalars = {"step": self.step, "epoch": self.epoch, "history": self.history, "processes": self.procs.world}
        save_state(self.out / "state", self.model, self.optimizer, self.scheduler, scalars, rng)
        keep = {e["epoch"] for e in self._candidates()} | {self._best()["epoch"], self.epoch}
        for f in epochs.glob("epoch*.safetensors"):
            if int(f.stem.removeprefix("epoch")) not in keep:
                f.unlink()

    def _best(self) -> dict[str, Any]:
        """The epoch record with the highest validation BLEU (the earliest on ties)."""
        return max(self.history, key=lambda e: e["valid_bleu"])

    def _candidates(self) -> list[dict[str, Any]]:
        """Epoch records to average: the last K or the best K by validation BLEU."""
        n = self.cfg.optim.average_count
        if self.cfg.optim.average == "last":
            return self.history[-n:]
        return sorted(self.history, key=lambda e: -e["valid_bleu"])[:n]

    def resume(self) -> None:
        """Continue from OUT/state, the end of the last finished epoch: rank 0 reads it and every
        process takes it from rank 0 (the run folder need only be on rank 0's machine). The logs
        are cut back to that point, so a run killed mid-epoch logs as an unbroken one."""
        tensors, scalars = read_state(self.out / "state") if self.procs.main else ({}, {})
        tensors, scalars = self.procs.broadcast((tensors, scalars))
        scalars = apply_state(tensors, scalars, self.model, self.optimizer, self.scheduler, self.procs.rank)
        if not scalars["rng_restored"]:  # a run resumed on more processes than it was saved by
            torch.manual_seed(self.cfg.optim.seed * 7919 + self.procs.rank + scalars["epoch"])
            log.warning("no RNG state for rank %d in %s: seeded afresh", self.procs.rank, self.out / "state")
        self.step, self.epoch, self.history = scalars["step"], scalars["epoch"], scalars["history"]
        if self.procs.main:
            (self.out / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in self.history))
            steps = self.out / "steps.jsonl"
            if steps.exists():
                kept = [ln for ln in steps.read_text().splitlines() if ln and json.loads(ln)["step"] <= self.step]
                steps.write_text("".join(ln + "\n" for ln in kept))
        log.info("resumed %s at epoch %d, step %d", self.out, self.epoch, self.step)

    def finish(self) -> Path:
        """Average, select (``optim.select``), write OUT/model with its scores."""
        files = [self.out / "epochs" / f"epoch{e['epoch']:03d}.safetensors" for e in self._candidates()]
        options = {"averaged": average_files(files)}
        best = self.out / "epochs" / f"epoch{self._best()['epoch']:03d}.safetensors"
        if self.cfg.optim.select == "val_bleu":
            if best.exists():
                options["best"] = load_file(str(best))
            else:  # runs made before the best epoch was always kept
                log.warning("%s is gone; choosing among the averaged checkpoint only", best)
        scores = {}
        for name, state in options.items():
            checkpoint.assign(self.model, state, name)
            scores[name] = self.validate()[1]
            log.info("%s checkpoint: valid BLEU %.2f", name, scores[name])
        chosen = max(scores, key=lambda k: scores[k])
        checkpoint.assign(self.model, options[chosen], chosen)
        meta = {
            "name": self.cfg.name,
            **(
                {"directions": [f"{s}-{t}" for s, t in self.pairs], "target_tags": True}
                if self.many
                else {"source_lang": self.cfg.data.source, "target_lang": self.cfg.data.target}
            ),
            "decoding": self.cfg.decoding.__dict__,
            "training": {
                "config": self.cfg.to_dict(),
                "epochs": self.epoch,
                "steps": self.step,
                "selected": chosen,
                "averaged_epochs": [e["epoch"] for e in self._candidates()],
                "valid_bleu_greedy": scores,
                "device": str(self.device),
                "processes": self.procs.world,
                "history": self.history,
            },
        }
        storage = torch.float16 if self.model.num_parameters() * 4 > 15 * 2**20 else torch.float32
        return checkpoint.save(self.out / "model", self.model, self.tokenizer, meta, dtype=storage)


def train(
    cfg: TrainConfig,
    out: Path,
    resume: bool = False,
    device: str = "auto",
    max_steps_per_epoch: int | None = None,
    time_budget_s: float | None = None,
    score: bool = True,
    processes: Processes | None = None,
) -> Path:
    """Train (or continue) a run and return the final checkpoint folder; ``score`` False skips
    its scores (``metrics.json``: greedy and beam search on val and test, minutes on a CPU),
    e.g. in a timed GPU call that brings the weights back to be scored elsewhere. Under
    torchrun (``processes``: default from the environment) every process trains and rank 0
    writes the folder; the others return its path once their part is done."""
    procs = processes or Processes.from_env()
    trainer = Trainer(cfg, out, resolve_device(device, procs), procs)
    try:
        if resume and procs.broadcast((out / "state" / "state.safetensors").exists() if procs.main else False):
            trainer.resume()
        trainer.run(max_steps_per_epoch, time_budget_s)
    finally:
        procs.stop()
    if not procs.main:
        return out / "model"
    final = trainer.finish()
    d, device = cfg.data, str(trainer.device)
    if not trainer.many:  # model.engine.shortlist's defaults
        if d.corpora:
            shortlists.write_shortlist_from(final, trainer.sample, "sample of the training corpora")
        else:
            shortlists.write_shortlist(final, trainer.data_dir)
    if not score:
        (final / checkpoint.METRICS).unlink(missing_ok=True)  # (a resumed run's earlier scores)
        return final
    if trainer.many:  # per direction, each source led by its target's tag
        metrics = {
            f"{s}-{t}": measure_checkpoint(final, trainer.data_dir, s, t, [d.valid, d.test], device, d.eval_limit)
            for s, t in trainer.pairs
        }
    elif d.corpora:
        sets = {"valid": trainer.valid_text, **{f"test:{k}": v for k, v in trainer.test_text.items()}}
        metrics = measure_sets(final, sets, d.source, d.target, device)
    else:
        splits = [d.valid, d.test]
        metrics = measure_checkpoint(final, trainer.data_dir, d.source, d.target, splits, device, d.eval_limit)
    (final / checkpoint.METRICS).write_text(json.dumps(metrics, indent=2) + "\n")
    return final


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--out", type=Path, help="run folder (default runs/<config name>)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/state (where there is one)")
    parser.add_argument(
        "--init",
        type=Path,
        help="a checkpoint folder to start from (fine-tuning): its weights, vocabulary and architecture",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    parser.add_argument("--max-steps-per-epoch", type=int, help="cap updates per epoch (smoke runs)")
    parser.add_argument(
        "--time-budget-minutes",
        type=float,
        help="start no epoch that would end past this many minutes of training (then average and score as usual)",
    )
    parser.add_argument(
        "--no-score",
        dest="score",
        action="store_false",
        help="write OUT/model without scoring it (no metrics.json; score it later with model.training.evaluate)",
    )
    args = parser.parse_args(argv)
    procs = Processes.from_env()
    level = logging.INFO if procs.main else logging.WARNING  # rank 0 logs the run; the others their problems
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s rank {procs.rank} %(name)s: %(message)s")
    cfg = load_train_config(args.config, init=args.init)
    out = args.out or Path("runs") / cfg.name
    budget = None if args.time_budget_minutes is None else args.time_budget_minutes * 60
    final = train(cfg, out, args.resume, args.device, args.max_steps_per_epoch, budget, args.score, procs)
    log.info("final checkpoint: %s", final)


if __name__ == "__main__":
    main()
