# syntax=docker/dockerfile:1
#
# The translation service with the shipped checkpoints baked in.
#
#   docker build -t transformer-translator .                          # CUDA-capable torch (PyPI's Linux build)
#   docker build --build-arg VARIANT=cpu -t transformer-translator:cpu .   # CPU-only torch, a much smaller image
#   docker run -p 8000:8000 transformer-translator:cpu
#   docker run -p 8000:8000 -v "$PWD/weights:/app/weights:ro" transformer-translator:cpu   # other weights
#
# tests/e2e/test_docker_install.py replays the builder's RUN steps and the runtime's ENV and CMD in a fresh
# virtual environment (with VARIANT=cpu), so keep every path in RUN steps behind $VIRTUAL_ENV.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
# cuda: torch from PyPI (its Linux x86_64 wheel bundles CUDA); cpu: PyTorch's CPU-only wheel.
ARG VARIANT=cuda
ARG TORCH_VERSION=2.13.0
# Overrides the index torch comes from (a mirror, or another CUDA build's index).
ARG TORCH_INDEX=""
ENV VIRTUAL_ENV=/opt/venv \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
RUN python -m venv "$VIRTUAL_ENV"
# torch alone first: the biggest layer, and the one that changes least. Its own dependencies come
# with the project's in the next step, from the default index.
RUN case "$VARIANT" in \
        cuda) index="${TORCH_INDEX:-https://pypi.org/simple}" ;; \
        cpu) index="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" ;; \
        *) echo "VARIANT must be cuda or cpu, not '$VARIANT'" >&2; exit 1 ;; \
    esac \
    && "$VIRTUAL_ENV/bin/pip" install --no-deps --index-url "$index" "torch==$TORCH_VERSION"
COPY pyproject.toml README.md ./
COPY app app
COPY model model
# A regular (not editable) install with `plot` (so every `translator` command runs here) and
# without the dev extras; pip check fails the build on a broken set.
RUN "$VIRTUAL_ENV/bin/pip" install ".[plot]" \
    && "$VIRTUAL_ENV/bin/pip" check
# The fused decoder-step kernels (model/engine/fused.py) compiled here, every x86 variant (AVX-512 VNNI, AVX-512, AVX2,
# baseline: the runtime picks by the CPU's features), into the venv, so the runtime needs no
# compiler: without them float32 decodes on tensor operations instead of the packed panels.
# (-P: the installed package, not the source tree in this folder.) FUSED_VARIANTS names fewer, e.g.
# for an image that only ever runs on one kind of CPU.
ARG FUSED_VARIANTS=""
# hadolint ignore=DL3008
RUN command -v g++ >/dev/null || { apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++ \
        && rm -rf /var/lib/apt/lists/*; }
# (unquoted on purpose: one argument a variant)
# hadolint ignore=SC2086
RUN case "$(uname -m)" in \
        x86_64) TORCH_EXTENSIONS_DIR="$VIRTUAL_ENV/kernels" "$VIRTUAL_ENV/bin/python" -P -m model.engine.fused --build $FUSED_VARIANTS ;; \
        *) echo "no fused-kernel variants for $(uname -m): the image decodes on tensor operations" ;; \
    esac


FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="transformer-translator" \
      org.opencontainers.image.description="Transformer (Attention Is All You Need) translation service"
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/app \
    XDG_CACHE_HOME=/tmp/.cache \
    TRANSLATOR_HOST=0.0.0.0 \
    TRANSLATOR_PORT=8000 \
    TRANSLATOR_WEIGHTS_DIR=/app/weights \
    TORCH_EXTENSIONS_DIR=/opt/venv/kernels
# mimalloc: `translator serve` re-executes itself on it (TRANSLATOR_MALLOC=auto; model/engine/allocator.py):
# lower batch memory than glibc's malloc at the same speed (docs/benchmarks/README.md#allocator).
# A runtime library, so the runtime stage installs it; the base image's Debian release fixes its version.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libmimalloc2.0 \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 translator \
    && useradd --system --uid 10001 --gid translator --home-dir /app --no-create-home --shell /usr/sbin/nologin translator
COPY --from=builder /opt/venv /opt/venv
WORKDIR /app
# Root-owned and read-only to the service user. Replace them by mounting a folder over /app/weights.
COPY weights/ weights/
USER 10001:10001
EXPOSE 8000
# Ready (200) only once every model is loaded and warmed up; slim images have no curl.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:' + os.environ.get('TRANSLATOR_PORT', '8000') + '/ready', timeout=4)"]
CMD ["translator", "serve"]
