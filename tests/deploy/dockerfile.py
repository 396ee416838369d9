"""A small Dockerfile reader and a replay of its steps on this machine, without a container engine.

``parse`` splits a Dockerfile into stages of instructions. ``Replay`` runs them under a fake root
folder: every absolute path that the Dockerfile itself creates (its WORKDIRs and COPY destinations,
e.g. /src, /opt/venv, /app) is mapped into that folder, ARG/ENV values are expanded as Docker does,
COPY copies from the build context, and RUN steps run through ``/bin/sh -c`` with that environment.
So the test replays the image's exact install commands and start command, and they cannot drift.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

_VAR = re.compile(
    r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?::(?P<op>[-+])(?P<word>[^}]*))?\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)
_FLAG = re.compile(r"^--([a-z-]+)=(\S+)$")


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: RUN, COPY, ...
    value: str  # the rest of the (joined) line


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def of(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.of(keyword)
        return found[-1] if found else None


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)


def logical_lines(text: str) -> list[str]:
    """Join ``\\`` continuations; drop comment lines (also inside continuations, as Docker does)."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        if raw.strip().startswith("#") or (not raw.strip() and not current):
            continue
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        lines.append((current + raw).strip())
        current = ""
    if current.strip():
        lines.append(current.strip())
    return [line for line in lines if line]


def parse(text: str) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical_lines(text):
        keyword, _, value = line.partition(" ")
        instruction = Instruction(keyword.upper(), value.strip())
        if instruction.keyword == "FROM":
            words = instruction.value.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(base=words[0], name=name))
        elif not stages:
            if instruction.keyword == "ARG":
                global_args.update(assignments(instruction.value))
        else:
            stages[-1].instructions.append(instruction)
    return Dockerfile(global_args, stages)


def assignments(value: str) -> dict[str, str]:
    """``A=1 B="x y"`` (ENV, ARG, LABEL) -> {"A": "1", "B": "x y"}; a bare ``ARG NAME`` maps to ""."""
    out: dict[str, str] = {}
    for word in shlex.split(value, posix=True):
        name, _, default = word.partition("=")
        out[name] = default
    return out


def exec_form(value: str) -> list[str]:
    """The JSON array of CMD/ENTRYPOINT/HEALTHCHECK CMD (shell form is not accepted here)."""
    parsed = json.loads(value)
    if not (isinstance(parsed, list) and all(isinstance(a, str) for a in parsed)):
        raise ValueError(f"not an exec-form array: {value}")
    return parsed


def split_flags(value: str) -> tuple[dict[str, str], list[str]]:
    """``--from=builder --chown=a:b src dest`` -> ({"from": "builder", "chown": "a:b"}, [src, dest])."""
    flags: dict[str, str] = {}
    words = shlex.split(value)
    while words and (match := _FLAG.match(words[0])):
        flags[match.group(1)] = match.group(2)
        words.pop(0)
    return flags, words


def healthcheck_command(value: str) -> list[str]:
    """The exec-form command of ``HEALTHCHECK [--options] CMD [...]``."""
    _, _, command = value.partition("CMD ")
    return exec_form(command.strip())


def expand(value: str, env: dict[str, str]) -> str:
    """Docker's variable substitution: ``$A``, ``${A}``, ``${A:-word}``, ``${A:+word}``."""

    def replace(match: re.Match[str]) -> str:
        name = match.group("braced") or match.group("bare")
        current = env.get(name, "")
        if match.group("op") == "-":
            return current or match.group("word")
        if match.group("op") == "+":
            return match.group("word") if current else ""
        return current

    return _VAR.sub(replace, value)


def image_roots(dockerfile: Dockerfile) -> set[str]:
    """Top-level folders the Dockerfile creates itself (WORKDIRs, absolute COPY destinations)."""
    roots: set[str] = set()
    for stage in dockerfile.stages:
        for instruction in stage.instructions:
            if instruction.keyword == "WORKDIR":
                roots.add(PurePosixPath(instruction.value).parts[1])
            elif instruction.keyword == "COPY":
                dest = split_flags(instruction.value)[1][-1]
                if dest.startswith("/"):
                    roots.add(PurePosixPath(dest).parts[1])
    return roots


@dataclass
class Replay:
    """Runs a Dockerfile's stages under ``root`` (see the module docstring)."""

    dockerfile: Dockerfile
    root: Path
    context: Path
    base_env: dict[str, str]
    build_args: dict[str, str] = field(default_factory=dict)
    context_overrides: dict[str, Path] = field(default_factory=dict)  # e.g. {"weights": a tiny checkpoint}
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.roots = image_roots(self.dockerfile)

    def path(self, container_path: str) -> Path:
        return self.root / container_path.lstrip("/")

    def map_value(self, raw: str, env: dict[str, str]) -> str:
        """Map the image's own absolute paths (also in PATH-like lists) into the root, then expand."""
        parts = []
        for part in raw.split(":"):
            if (
                part.startswith("/")
                and len(PurePosixPath(part).parts) > 1
                and PurePosixPath(part).parts[1] in self.roots
            ):
                part = str(self.path(part))
            parts.append(part)
        return expand(":".join(parts), env)

    def run_stage(self, name: str, run_steps: bool = True) -> tuple[dict[str, str], Path]:
        """Replay one stage; return its final environment and working directory."""
        stage = self.dockerfile.stage(name)
        env = dict(self.base_env)
        workdir = self.root
        for instruction in stage.instructions:
            keyword, value = instruction.keyword, instruction.value
            if keyword == "ARG":
                for arg, default in assignments(value).items():
                    given = self.build_args.get(arg, self.dockerfile.global_args.get(arg, default))
                    env[arg] = expand(given, env)
            elif keyword == "ENV":
                for var, raw in assignments(value).items():
                    env[var] = self.map_value(raw, env)
            elif keyword == "WORKDIR":
                workdir = self.path(expand(value, env))
                workdir.mkdir(parents=True, exist_ok=True)
            elif keyword == "COPY":
                self.copy(value, workdir, env)
            elif keyword == "RUN" and run_steps:
                self.run(value, workdir, env)
        return env, workdir

    def run(self, command: str, workdir: Path, env: dict[str, str]) -> None:
        for root in self.roots:
            if re.search(rf"(?<![\w$.}}])/{re.escape(root)}\b", command):
                raise ValueError(f"RUN names the image path /{root} literally; use a variable: {command}")
        self.log.append(f"+ {command}")
        done = subprocess.run(
            ["/bin/sh", "-c", command], cwd=workdir, env=env, capture_output=True, text=True, check=False
        )
        self.log.append(done.stdout[-3000:] + done.stderr[-3000:])
        if done.returncode != 0:
            raise RuntimeError(f"RUN failed ({done.returncode}): {command}\n" + "\n".join(self.log[-1:]))

    def copy(self, value: str, workdir: Path, env: dict[str, str]) -> None:
        flags, words = split_flags(expand(value, env))
        *sources, dest = words
        target = self.path(dest) if dest.startswith("/") else workdir / dest
        for source in sources:
            origin = self.path(source) if "from" in flags else self.source(source)
            if origin.resolve() == target.resolve():
                continue  # COPY --from=builder /opt/venv /opt/venv: both stages share the root here
            if origin.is_dir():
                shutil.copytree(origin, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                into = target if dest.endswith("/") or target.is_dir() else target.parent
                into.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, into / origin.name if into == target else target)

    def source(self, name: str) -> Path:
        key = name.strip("/")
        if key in self.context_overrides:
            return self.context_overrides[key]
        return self.context / key


def host_env(extra_path: list[Path]) -> dict[str, str]:
    """What a build or container sees from the host: PATH (plus ``extra_path`` first), locale and
    pip's own configuration (its index mirrors and find-links), nothing of the test's virtualenv."""
    keep = {"LANG", "LC_ALL", "TMPDIR", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"}
    env = {k: v for k, v in os.environ.items() if k in keep or k.startswith(("PIP_", "HTTP_", "HTTPS_", "NO_PROXY"))}
    own_bin = str(Path(sys.prefix) / "bin") if sys.prefix != sys.base_prefix else ""
    host_path = [p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep) if p and p != own_bin]
    env["PATH"] = os.pathsep.join([*map(str, extra_path), *host_path])
    return env
