"""The ``translator`` command line: subcommands, --version, and serve's flags from Settings."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from app import version
from app.cli import COMMANDS, serve_settings
from app.settings import Settings
from tests.helpers import ROOT


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def test_help_lists_every_subcommand_with_a_description() -> None:
    out = cli("--help")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for name, (summary, _) in COMMANDS.items():
        at = next(i for i, ln in enumerate(lines) if ln.split()[:1] == [name])
        described = " ".join(lines[at : at + 2])  # argparse puts the help of a long name on the next line
        assert summary.split()[0] in described
    assert cli().returncode == 2 and "COMMAND" in cli().stderr  # no command: usage error


def test_version_comes_from_the_package_metadata() -> None:
    out = cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"translator {metadata.version('transformer-translator')}"
    assert version() == metadata.version("transformer-translator")


@pytest.mark.slow
def test_serve_help_has_every_setting_with_its_variable_and_default() -> None:
    out = cli("serve", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for name in Settings.model_fields:
        assert f"--{name.replace('_', '-')}" in text
        assert f"TRANSLATOR_{name.upper()};" in text
    assert "(TRANSLATOR_PORT; default: 8000)" in text and "(TRANSLATOR_MAX_WAIT_MS; default: 5.0)" in text


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRANSLATOR_PORT", "9000")
    monkeypatch.setenv("TRANSLATOR_MAX_BEAM", "6")
    settings = serve_settings(["--port", "9100", "--api-keys", "a, b", "--weights-dir", "/tmp/w", "--dtype", "int8"])
    assert settings.port == 9100 and settings.max_beam == 6  # the flag wins, the variable still applies
    assert settings.api_keys == ["a", "b"] and settings.weights_dir == Path("/tmp/w") and settings.dtype == "int8"


@pytest.mark.slow
def test_an_invalid_flag_exits_2_naming_it_without_serving() -> None:
    out = cli("serve", "--port", "0")
    assert out.returncode == 2 and "--port" in out.stderr and "greater than or equal to 1" in out.stderr
    out = cli("serve", "--dtype", "int4")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_module_subcommands_name_themselves_after_the_command() -> None:
    out = cli("evaluate", "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: translator evaluate")


def test_bench_lists_and_runs_the_benchmarks() -> None:
    listing = cli("bench", "--help")
    assert listing.returncode == 0
    for name in ("decode", "load", "overload", "soak", "batching", "kernels", "plot"):
        assert f"    {name} " in listing.stdout
    out = cli("bench", "load", "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: translator bench load") and "--url" in out.stdout


# In a fresh interpreter where matplotlib cannot be imported (as in an install without the ``plot``
# extra: a finder ahead of the others answers ModuleNotFoundError, like a module that is not
# there), each command line runs through ``app.cli.main``; -> [exit status, stdout, stderr] each.
WITHOUT_MATPLOTLIB = """
import contextlib, importlib.abc, io, json, sys

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "matplotlib":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Missing())
from app.cli import main

results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else str(exit.code))
    results.append([code, out.getvalue(), err.getvalue()])
assert "matplotlib" not in sys.modules
print(json.dumps(results))
"""


@pytest.mark.slow  # one interpreter, ~8 s: every command line in it
def test_every_help_works_without_the_plot_extra(tmp_path: Path) -> None:
    """``translator plot --help`` and every other command's help print their usage in an install
    without matplotlib; drawing without it exits with the install hint, naming the extra."""
    import json

    from app.cli import BENCHMARKS

    record = {"epoch": 1, "train_loss": 2.0, "valid_loss": 2.1, "valid_bleu": 3.0, "lr": 1e-3}
    (tmp_path / "log.jsonl").write_text(json.dumps(record) + "\n")
    helps = [[name, "--help"] for name in COMMANDS] + [
        ["plot", "training", "--help"],
        ["plot", "attention", "--help"],
        ["data", "multi30k", "--help"],
        ["suggestions", "export", "--help"],
        *[["bench", name, "--help"] for name in BENCHMARKS],
    ]
    argvs = [["--help"], *helps, ["plot", "training", str(tmp_path)]]
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_MATPLOTLIB, json.dumps(argvs)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.splitlines()[-1])
    for argv, (code, stdout, stderr) in zip(argvs[:-1], results[:-1], strict=True):
        assert code == 0 and stdout.startswith("usage: translator"), (argv, code, stderr[-2000:])
    code, _, _ = results[-1]
    assert isinstance(code, str) and "pip install 'transformer-translator[plot]'" in code
    assert not (tmp_path / "training.png").exists()
