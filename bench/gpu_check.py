"""One command that answers whether the service works on a GPU, kept alive on the CPU by CI.

    bench/gpu_check.sh OUTDIR [options]          (a lent device: installs carried wheels first)
    python -m bench.gpu_check --out OUTDIR [--device auto|cpu|cuda] [--sentences N]
        [--languages de,en] [--repeat 2] [--train recipe|tiny] [--budget-s 540] [--quick]

On the device it finds (``auto``: CUDA where torch sees one) it runs, in order:

- ``environment``: torch, CUDA, the GPU, the packages the service needs, the data and weights found;
- ``tests``: ``pytest -m gpu tests/gpu`` (every ``gpu``-marked test lives there), passed/skipped counts;
- ``serve``: ``translator serve`` as a real process on ``TRANSLATOR_DEVICE=--device`` (auto by
  default) over weights/; ``/info`` and the ``translator_model_info`` metric must name the device;
  the first ``--sentences`` of test_2016_flickr de→en through ``/translate`` (8 clients, 16 sentences a
  request), scored with sacreBLEU; one ``/attention``;
- ``decode``: ``bench.decode`` of ours against Hugging Face ``MarianMTModel.generate`` on the same
  weights (``bench.marian_convert``), greedy and beam 4, batches of 64 and one sentence at a time,
  float32 and half precision: float16 on CUDA, bfloat16 on the CPU (its float16 is a slow path the
  service never picks; docs/gpu.md);
- ``train``: a short ``translator train`` (``model.training.train``): the de-en recipe under a time
  budget (``recipe``), or a few steps of a tiny model (``tiny``, the CPU's default).

Each stage runs in a child process under a deadline (``--budget-s`` shared out by ``SHARES``; time
a stage leaves goes to the later ones), so one that hangs or fails leaves the others theirs. OUTDIR
gets four files (the device tool brings back at most eight): ``results.jsonl``, one JSON line per
result, each naming its ``stage`` and ``kind``, and one ``kind: "stage"`` line per stage with its
status; ``summary.json``; ``summary.md``; ``log.txt``, every stage's output. Nothing is installed
and nothing is fetched: the data comes from ``--data`` (default ``MULTI30K_DIR``, else
``.gpu-kit/data/multi30k``). Exit status 0 when every stage is ``ok``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / ".gpu-kit"  # git-ignored: what a device run carries (data, wheels; docs/gpu.md)
# each stage's share of the time budget (decode runs 16 cells, each with two systems)
SHARES = {"environment": 0.03, "tests": 0.22, "serve": 0.2, "decode": 0.35, "train": 0.2}
HALF = {"cuda": "float16", "cpu": "bfloat16"}
# bench.decode's cells (precision, beam, batch size; "half" is ``HALF``'s) and the two of them that
# between them take every value of each, which CI runs (one sentence at a time is --batch-size 1)
CELLS = [(dtype, beam, batch) for dtype in ("float32", "half") for beam in (1, 4) for batch in (64, 1)]
QUICK = [("float32", 4, 1), ("half", 1, 64)]
SINGLE = 32  # sentences of the one-sentence-at-a-time cells, timed once (a GPU's per-step cost rules there)
PACKAGES = ("torch", "transformers", "fastapi", "uvicorn", "pydantic", "pydantic-settings", "sacrebleu", "httpx")
BLEU_TOLERANCE = 1.0  # served test_2016 BLEU against the model card's, as tests/gpu's half-precision check


@dataclass(frozen=True)
class Kit:
    out: Path
    device: str  # the setting: auto, cpu or cuda
    resolved: str  # what it means here: cpu or cuda
    data: Path
    sentences: int
    languages: str
    repeat: int
    train: str
    budget_s: float
    quick: bool  # CI's keep-alive run: the decode cells of ``QUICK`` only


def emit(line: dict[str, Any]) -> None:
    """A result line on stdout, where the parent collects it."""
    print(json.dumps(line), flush=True)


# --- stages (each runs in a child process: ``--stage NAME``) ---------------------------------------


def stage_environment(kit: Kit) -> Iterator[dict[str, Any]]:
    import torch

    from bench.decode import cpu_name

    cuda = torch.cuda.is_available()
    packages = {}
    for name in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            packages[name] = metadata.version(name)
    weights = sorted(p.name for p in (ROOT / "weights").iterdir() if (p / "config.json").is_file())
    data_ok = all((kit.data / f"test_2016_flickr.{lang}.gz").is_file() for lang in ("de", "en"))
    yield {
        "kind": "environment",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "cpu": cpu_name(),
        "packages": packages,
        "data": str(kit.data),
        "weights": weights,
        "ok": data_ok and bool(weights) and set(packages) == set(PACKAGES),
    }


def stage_tests(kit: Kit) -> Iterator[dict[str, Any]]:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-p", "no:cacheprovider"]
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed = []
    with tempfile.TemporaryDirectory() as tmp:  # (nothing but the four files in OUTDIR)
        report = Path(tmp) / "pytest.xml"
        proc = subprocess.run([*cmd, f"--junitxml={report}"], cwd=ROOT, check=False)
        cases = ET.parse(report).getroot().iter("testcase") if report.is_file() else iter(())
        for case in cases:
            outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            counts[{"failure": "failed", "error": "errors"}.get(outcome, outcome)] += 1
            if outcome in ("failure", "error"):
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    ran = counts["passed"] > 0 or kit.resolved == "cpu"  # on the CPU every one is skipped
    ok = proc.returncode in (0, 5) and not failed and ran  # (5: pytest collected none)
    yield {"kind": "pytest", **counts, "failing": failed, "returncode": proc.returncode, "ok": ok}


def stage_serve(kit: Kit, timeout: float) -> Iterator[dict[str, Any]]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from bench.server import running_server

    env = {
        "TRANSLATOR_WEIGHTS_DIR": str(ROOT / "weights"),
        "TRANSLATOR_DEVICE": kit.device,
        "TRANSLATOR_LOAD_ONLY": kit.languages,
        "TRANSLATOR_CACHE_SIZE": "0",  # every sentence decoded, none answered from the cache
    }
    start = time.perf_counter()
    with running_server(env, ready_timeout=timeout) as url:
        ready_s = round(time.perf_counter() - start, 1)
        directions = httpx.get(f"{url}/info", timeout=30).json()["directions"]
        devices = sorted({d["device"] for d in directions})
        yield {
            "kind": "info",
            "directions": len(directions),
            "devices": devices,
            "ready_s": ready_s,
            "dtypes": sorted({d["dtype"] for d in directions}),
            "ok": devices == [kit.resolved],
        }
        families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text)
        samples = [s for f in families if f.name == "translator_model_info" for s in f.samples]
        named = sorted({s.labels["device"] for s in samples})
        yield {"kind": "metric", "samples": len(samples), "devices": named, "ok": named == [kit.resolved]}
        yield translate_through(url, kit)
        yield attention_through(url)


def translate_through(url: str, kit: Kit) -> dict[str, Any]:
    """The test set de→en through /translate: 8 clients, 16 sentences a request, scored."""
    import httpx

    from model import checkpoint
    from model.training.data import read_lines
    from model.training.evaluate import score_translations

    src = read_lines(kit.data / "test_2016_flickr.de.gz")[: kit.sentences]
    ref = read_lines(kit.data / "test_2016_flickr.en.gz")[: kit.sentences]
    chunks = [src[i : i + 16] for i in range(0, len(src), 16)]
    with httpx.Client(timeout=300) as client:

        def post(chunk: list[str]) -> list[str]:
            response = client.post(f"{url}/translate", json={"q": chunk, "source": "de", "target": "en"})
            response.raise_for_status()
            return list(response.json()["translatedText"])

        start = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            out = [text for texts in pool.map(post, chunks) for text in texts]
        seconds = time.perf_counter() - start
    scores = {k: v for k, v in score_translations(out, ref).items() if k != "signatures"}
    card = json.loads((ROOT / "weights" / "de-en" / checkpoint.METRICS).read_text())["test_2016_flickr"]
    card_bleu = max(card.values(), key=lambda s: s["bleu"])["bleu"]  # (its beam row)
    whole = len(src) == card["greedy"]["sentences"]  # the card's score is for the whole set
    ok = all(out) and (not whole or abs(scores["bleu"] - card_bleu) <= BLEU_TOLERANCE)
    return {
        "kind": "translate",
        "direction": "de-en",
        "sentences": len(src),
        "seconds": round(seconds, 2),
        "sentences_per_s": round(len(src) / seconds, 1),
        **scores,
        "card_bleu": card_bleu,
        "ok": ok,
    }


def attention_through(url: str) -> dict[str, Any]:
    import httpx

    body = {"q": "Ein Mann fährt mit dem Fahrrad.", "source": "de", "target": "en", "kinds": ["cross"]}
    out = httpx.post(f"{url}/attention", json=body, timeout=60).json()
    cross = out["attention"]["cross"]
    shape = [len(cross), len(cross[0]), len(cross[0][0]), len(cross[0][0][0])]
    rows = [sum(row) for layer in cross for head in layer for row in head]
    expected = [out["n_decoder_layers"], out["n_heads"], len(out["target_tokens"]), len(out["source_tokens"])]
    ok = shape == expected and all(abs(r - 1) < 0.02 for r in rows)
    return {"kind": "attention", "translation": out["translatedText"], "shape": shape, "ok": ok}


def stage_decode(kit: Kit) -> Iterator[dict[str, Any]]:
    """bench.decode's cells, in this one process (no process per system: on a GPU their start-up
    would take much of the budget), each line as bench.decode prints it."""
    from bench import decode

    for precision, beam, batch in QUICK if kit.quick else CELLS:
        dtype = HALF[kit.resolved] if precision == "half" else precision
        n, repeat = (kit.sentences, kit.repeat) if batch > 1 else (min(kit.sentences, SINGLE), 1)
        cell = {"dtype": dtype, "beam_size": beam, "batch_size": batch}
        argv = f"--device {kit.resolved} --dtype {dtype} --beam-size {beam} --batch-size {batch} --limit {n}"
        warmup = min(16 if batch > 1 else 4, max(n // 2, 1))
        argv += f" --warmup {warmup} --repeat {repeat} --systems ours,marian --no-isolate"
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                decode.main([*argv.split(), "--data-dir", str(kit.data)])
        except Exception as err:  # one cell's failure is a result; the others still run
            yield {"kind": "decode", **cell, "error": f"{type(err).__name__}: {err}", "ok": False}
        for line in printed.getvalue().splitlines():
            yield {"kind": "decode", **json.loads(line), "ok": True}


TINY_TRAIN = """
name = "gpu-check-tiny"
[data]
dir = "{data}"
[tokenizer]
vocab_size = 500
[model]
d_model = 32
n_heads = 2
encoder_layers = 1
decoder_layers = 1
d_ff = 64
max_positions = 128
[optim]
max_epochs = 1
max_tokens = 1500
warmup_steps = 10
bf16 = false
average_count = 1
threads = 2
"""
TINY_LINES = {"train": 3000, "val": 16, "test_2016_flickr": 16}  # the tiny run's data: its splits' first lines


def stage_train(kit: Kit, timeout: float) -> Iterator[dict[str, Any]]:
    """``tiny``: three steps of a tiny model on a slice of the data (so its tokenizer and shortlist
    take seconds); ``recipe``: configs/de-en.toml on the data folder, stopped by a time budget that
    leaves the averaging and the shortlist their time. ``--no-score``: the epochs' validation BLEU says enough."""
    from model.training.data import read_lines, write_lines

    with tempfile.TemporaryDirectory() as tmp:
        folder, data = Path(tmp), kit.data
        cmd = [sys.executable, "-m", "model.training.train", "--config", f"{tmp}/config.toml", "--out", f"{tmp}/run"]
        cmd += ["--device", kit.resolved, "--no-score"]
        if kit.train == "tiny":
            data = folder / "data"
            data.mkdir()
            for (split, n), lang in itertools.product(TINY_LINES.items(), ("de", "en")):
                write_lines(data / f"{split}.{lang}.gz", read_lines(kit.data / f"{split}.{lang}.gz")[:n])
            (folder / "config.toml").write_text(TINY_TRAIN.format(data=data))
            cmd += ["--max-steps-per-epoch", "3"]
        else:
            recipe = (ROOT / "configs" / "de-en.toml").read_text()
            (folder / "config.toml").write_text(recipe.replace('dir = "../shared/data/multi30k"', f'dir = "{data}"'))
            cmd += ["--time-budget-minutes", f"{max(timeout - 60, 12) / 60:.2f}"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, check=False)
        log = folder / "run" / "log.jsonl"
        epochs = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
        written = (folder / "run" / "model" / "config.json").is_file()
    last = epochs[-1] if epochs else {}
    yield {
        "kind": "train",
        "config": kit.train,
        "epochs": len(epochs),
        "steps": last.get("step"),
        "train_loss": [e["train_loss"] for e in epochs],
        "valid_bleu": last.get("valid_bleu"),
        "tokens_per_s": last.get("tokens_per_s"),
        "seconds": round(time.perf_counter() - start, 1),
        "ok": proc.returncode == 0 and bool(epochs) and written,
    }


def run_stage(name: str, kit: Kit, timeout: float) -> None:
    """In the child: the stage's lines on stdout."""
    stages = {
        "environment": lambda: stage_environment(kit),
        "tests": lambda: stage_tests(kit),
        "serve": lambda: stage_serve(kit, timeout),
        "decode": lambda: stage_decode(kit),
        "train": lambda: stage_train(kit, timeout),
    }
    for line in stages[name]():
        emit({"stage": name, **line})


# --- the parent: stages under deadlines, then the summary ------------------------------------------


@dataclass(frozen=True)
class StageRun:
    stage: str
    status: str  # ok, failed (a result not ok, or the process failed) or timeout
    seconds: float
    cpu_s: float  # the stage's processes' CPU time (user and system), the server's included
    results: int
    returncode: int | None


def run_child(name: str, kit: Kit, argv: list[str], timeout: float, log: Any) -> tuple[StageRun, list[dict[str, Any]]]:
    """One stage in a child process (and its own process group, so a server it started goes
    with it on a timeout) -> its run and result lines."""
    cmd = [sys.executable, "-m", "bench.gpu_check", *argv, "--stage", name, "--stage-timeout", str(timeout)]
    env = {**os.environ, "MULTI30K_DIR": str(kit.data), "PYTHONUNBUFFERED": "1"}
    start, cpu = time.perf_counter(), children_cpu_s()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        timed_out = True
    seconds = round(time.perf_counter() - start, 1)
    log.write(f"\n===== {name} ({seconds} s, exit {proc.returncode}) =====\n{output}")
    lines = [json.loads(line) for line in output.splitlines() if line.startswith('{"stage": ')]
    ok = proc.returncode == 0 and bool(lines) and all(line.get("ok", True) for line in lines)
    status = "timeout" if timed_out else "ok" if ok else "failed"
    cpu_s = round(children_cpu_s() - cpu, 1)
    return StageRun(name, status, seconds, cpu_s, len(lines), None if timed_out else proc.returncode), lines


def children_cpu_s() -> float:
    """CPU seconds of this process's reaped descendants (each stage's child and what it waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def summary_markdown(summary: dict[str, Any], lines: list[dict[str, Any]]) -> str:
    env = next((line for line in lines if line["kind"] == "environment"), {})
    out = [
        f"# GPU check: {summary['device']} ({env.get('gpu') or env.get('cpu')})",
        "",
        f"torch {env.get('torch')}, CUDA {env.get('cuda')}; {summary['seconds']} s in all.",
        "",
        "| stage | status | seconds | CPU seconds | results |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    out += [
        f"| {s['stage']} | {s['status']} | {s['seconds']} | {s['cpu_s']} | {s['results']} |" for s in summary["stages"]
    ]
    out += [
        "",
        "| system | dtype | beam | batch | sentences | sentences/s | BLEU |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for d in (line for line in lines if line["kind"] == "decode"):
        out.append(
            f"| {d.get('system', '-')} | {d['dtype']} | {d['beam_size']} | {d['batch_size']} | "
            f"{d.get('sentences', '-')} | {d.get('sentences_per_s', d.get('error'))} | {d.get('bleu', '-')} |"
        )
    out += ["", "Other results:", ""]
    out += [f"- `{json.dumps(line)}`" for line in lines if line["kind"] not in ("decode", "environment", "stage")]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for results.jsonl, summary.*, log.txt")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--sentences", type=int, default=1000, help="test_2016_flickr sentences (one at a time: 32)")
    parser.add_argument("--languages", default="", help="serve only these (TRANSLATOR_LOAD_ONLY); default all")
    parser.add_argument("--repeat", type=int, default=2, help="bench.decode's timed passes per cell")
    parser.add_argument("--train", choices=("recipe", "tiny"), help="default: recipe on CUDA, tiny on the CPU")
    parser.add_argument("--data", type=Path, help="Multi30k folder (default MULTI30K_DIR, else .gpu-kit/data/multi30k)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="all stages together, in seconds")
    parser.add_argument("--quick", action="store_true", help="CI's keep-alive: the decode cells of QUICK only")
    parser.add_argument("--stage", choices=tuple(SHARES), help=argparse.SUPPRESS)  # (the child's)
    parser.add_argument("--stage-timeout", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    kit = make_kit(args)
    if args.stage:
        run_stage(args.stage, kit, args.stage_timeout)
        return 0
    kit.out.mkdir(parents=True, exist_ok=True)
    given = {name: value for name, value in asdict(kit).items() if name not in ("resolved", "quick")}
    child_argv = [f"--{name.replace('_', '-')}={value}" for name, value in given.items()] + ["--quick"] * kit.quick
    runs, lines = [], []
    start = time.perf_counter()
    with (kit.out / "log.txt").open("w") as log:
        for i, name in enumerate(SHARES):
            left = kit.budget_s - (time.perf_counter() - start)
            share = SHARES[name] / sum(list(SHARES.values())[i:])  # (time a stage leaves goes to the later ones)
            run, found = run_child(name, kit, child_argv, max(left * share, 10.0), log)
            runs.append(run)
            lines += [*found, {"stage": name, "kind": "stage", **asdict(run)}]
    with (kit.out / "results.jsonl").open("w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    summary = {
        "device": kit.resolved,
        "setting": kit.device,
        "sentences": kit.sentences,
        "seconds": round(time.perf_counter() - start, 1),
        "stages": [asdict(r) for r in runs],
        "failed": [line for line in lines if line.get("ok") is False],
    }
    (kit.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (kit.out / "summary.md").write_text(summary_markdown(summary, lines))
    return 0 if all(r.status == "ok" for r in runs) else 1


def make_kit(args: argparse.Namespace) -> Kit:
    import torch

    from model.training.data import MULTI30K_DIR

    resolved = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    data = args.data or (MULTI30K_DIR if MULTI30K_DIR.is_dir() else KIT / "data" / "multi30k")
    train = args.train or ("recipe" if resolved == "cuda" else "tiny")
    settings = {k: getattr(args, k) for k in ("device", "sentences", "languages", "repeat", "budget_s", "quick")}
    return Kit(out=args.out.resolve(), resolved=resolved, data=data.resolve(), train=train, **settings)


if __name__ == "__main__":
    raise SystemExit(main())
