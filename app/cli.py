"""The ``translator`` command: serve the model, or run training, evaluation and plotting.

``translator serve`` takes every service setting as a flag, generated from ``Settings`` (its
description is the help text, its default and ``TRANSLATOR_*`` variable are shown), so the
flags and the environment variables cannot drift apart. The other subcommands hand their
arguments to the module's own parser (``translator train --help``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import typing
from collections.abc import Callable

from pydantic import ValidationError

from app import version
from app.observability.logs import configure_logging
from app.settings import Settings
from model.engine.allocator import MallocUnavailable, exec_with_malloc


def _train(argv: list[str]) -> None:
    from model.training.train import main

    main(argv)


def _evaluate(argv: list[str]) -> None:
    from model.training.evaluate import main

    main(argv)


def _plot(argv: list[str]) -> None:
    # matplotlib (the ``plot`` extra) is imported only to draw: --help works without it, a
    # picture without it exits with the install hint (model.training.plot.new_figure)
    from model.training.plot import main

    raise SystemExit(main(argv))  # its status: 2 for a bad run folder, text or layer


def _import(argv: list[str]) -> None:
    from model.imports import main

    main(argv)


def _suggestions(argv: list[str]) -> None:
    from app.storage.suggestions import main

    raise SystemExit(main(argv))


def _data(argv: list[str]) -> None:
    datasets = {"multi30k": "Multi30k task 1: download, verify and cache (train, val, test_2016_flickr)"}
    if not argv or argv[0] not in datasets:
        parser = argparse.ArgumentParser(prog="translator data", description="Fetch a data set.")
        parser.add_argument(
            "dataset", choices=sorted(datasets), help="; ".join(f"{k}: {v}" for k, v in datasets.items())
        )
        parser.parse_args(argv[:1])  # --help (exit 0), or a usage error (exit 2)
        return
    from model.training.multi30k import main

    raise SystemExit(main(argv[1:]))


# The benchmarks in bench/ (`translator bench NAME --help`); they need the dev extra's peers.
BENCHMARKS = {
    "decode": "decoding throughput of ours against CTranslate2, Marian and the naive decoder",
    "load": "closed-loop clients against a real server (or any LibreTranslate-compatible one)",
    "overload": "goodput under overload: polite against impatient retries on a small queue",
    "soak": "memory of a real server over thousands of varied requests",
    "detect": "language detectors compared on Multi30k: accuracy, latency, memory",
    "batching": "static against continuous batching in one process",
    "kernels": "per-call time of each linear kernel at the shipped model's shapes",
    "compile_step": "the small-batch decoder step eager against torch.compile (inductor)",
    "plot": "charts of bench load and bench decode lines (the pictures of docs/benchmarks/)",
    "train_memory": "memory of training on streamed corpora of a few million pairs (docs/training.md)",
}


def _bench(argv: list[str]) -> None:
    import importlib

    parser = argparse.ArgumentParser(
        prog="translator bench",
        description="Run a benchmark from bench/ (commands and results: docs/benchmarks/README.md). "
        "Needs the dev extra: pip install 'transformer-translator[dev]'.",
    )
    names = parser.add_subparsers(dest="name", metavar="NAME", required=True)
    for name, summary in BENCHMARKS.items():
        names.add_parser(name, help=summary, add_help=False)
    if not argv or argv[0] not in BENCHMARKS:
        parser.parse_args(argv)  # --help, or a usage error (exit 2)
        return
    try:
        module = importlib.import_module(f"bench.{argv[0]}")
    except ModuleNotFoundError as err:
        raise SystemExit(
            f"translator bench {argv[0]} needs {err.name}: pip install 'transformer-translator[dev]'"
        ) from None
    sys.argv[0] = f"translator bench {argv[0]}"
    module.main(argv[1:])


# name -> (one-line description, runner); serve has its own parser below
COMMANDS: dict[str, tuple[str, Callable[[list[str]], None] | None]] = {
    "serve": ("serve the checkpoints under the weights folder over HTTP", None),
    "train": (
        "train a model from a config (configs/ reproduce the shipped weights; your own corpora; --init to "
        "fine-tune; several processes: torchrun -m model.training.train)",
        _train,
    ),
    "evaluate": ("translate a test set and score it with sacreBLEU", _evaluate),
    "plot": (
        "draw a translation's attention heads as heatmaps, or a training run's curves (plot training RUN_DIR)",
        _plot,
    ),
    "data": ("download and verify a data set: translator data multi30k", _data),
    "import": (
        "import an OPUS-MT (Marian) folder or an Argos Translate package: translator import PATH --out DIR",
        _import,
    ),
    "suggestions": ("export the translations users suggested (POST /suggest) as a parallel corpus", _suggestions),
    "bench": ("run a benchmark from bench/ (decode, load, overload, soak, ...)", _bench),
}


def settings_parser() -> argparse.ArgumentParser:
    """``translator serve``'s parser: one flag per ``Settings`` field."""
    parser = argparse.ArgumentParser(
        prog="translator serve",
        description="Serve the checkpoints under the weights folder over HTTP. Every flag has a "
        "TRANSLATOR_* environment variable; a flag overrides its variable.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for name, field in Settings.model_fields.items():
        env = f"TRANSLATOR_{name.upper()}"
        default = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
        shown = ",".join(default) if isinstance(default, list) else default
        choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else None
        parser.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            metavar=None if choices else name.split("_")[-1].upper(),
            choices=choices,
            default=argparse.SUPPRESS,
            help=f"{field.description or name} ({env}; default: {shown})",
        )
    return parser


def serve_settings(argv: list[str]) -> Settings:
    """The settings ``translator serve argv`` runs with (the environment, then the flags);
    an invalid value exits with status 2 and the setting's name."""
    parser = settings_parser()
    given = vars(parser.parse_args(argv))
    try:
        return Settings(**given)
    except ValidationError as err:
        problems = "; ".join(f"--{'.'.join(map(str, e['loc'])).replace('_', '-')}: {e['msg']}" for e in err.errors())
        parser.error(problems)


def serve(argv: list[str]) -> None:
    settings = serve_settings(argv)
    configure_logging(settings.log_level)
    if sys.argv[1:] == ["serve", *argv]:  # this process's own command line: it can be run again
        try:
            # before the app (and torch) is imported: a re-executed process imports it again
            exec_with_malloc(settings.malloc)  # (returns where the allocator is the one wanted)
        except MallocUnavailable as err:
            raise SystemExit(f"translator serve: {err}") from err
    import uvicorn

    from app.main import create_app

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,
        # app.access logs each request (with its id); uvicorn's own is disabled (app.observability.logs)
        access_log=False,
        # the app cuts requests off after the drain timeout itself (AppState.drain_on_signals);
        # uvicorn's own limit is a backstop a second later
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout_s) + 1,
    )


def main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="translator",
        description="A self-hosted Transformer translation service. Each command takes --help.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (summary, _) in COMMANDS.items():
        commands.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        main_parser().parse_args(argv)  # --help, --version, or a usage error (exit 2)
        return
    command, rest = argv[0], argv[1:]
    runner = COMMANDS[command][1]
    configure_logging(os.environ.get("TRANSLATOR_LOG_LEVEL", "info"))  # serve: again, from its settings
    if runner is None:
        serve(rest)
    else:
        sys.argv[0] = f"translator {command}"  # the module's own parser names itself after it
        runner(rest)


if __name__ == "__main__":
    main()
