"""The ``translator`` command: serve the model, or run training, evaluation and plotting."""

from __future__ import annotations

import argparse
import math
import sys


def serve(argv: list[str]) -> None:
    import uvicorn

    from app.main import create_app
    from app.middleware import configure_logging
    from app.settings import Settings

    parser = argparse.ArgumentParser(
        prog="translator serve",
        description="Serve the shipped checkpoints over HTTP. "
        "Every TRANSLATOR_* environment variable applies; flags override them.",
    )
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--weights-dir")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    settings = Settings(**overrides)
    configure_logging(settings.log_level)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,
        # the app cuts requests off after the drain timeout itself (AppState.drain_on_signals);
        # uvicorn's own limit is a backstop a second later
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout_s) + 1,
    )


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"serve", "train", "evaluate", "plot"}
    if not argv or argv[0] not in commands:
        print("usage: translator {serve,train,evaluate,plot} [options]  (each takes --help)", file=sys.stderr)
        raise SystemExit(2)
    command, rest = argv[0], argv[1:]
    if command == "serve":
        serve(rest)
    elif command == "train":
        from model.train import main as train_main

        train_main(rest)
    elif command == "evaluate":
        from model.evaluate import main as evaluate_main

        evaluate_main(rest)
    else:
        from model.plot import main as plot_main

        plot_main(rest)


if __name__ == "__main__":
    main()
