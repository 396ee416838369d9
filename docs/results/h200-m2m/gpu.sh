#!/bin/bash
# The device driver of the session of 2026-11-29 22:57 (one NVIDIA H200): the two many-to-many runs named in
# RUNS (configs/experiments/*.toml) side by side on the GPU under one time budget, each with the shipped
# vocabulary (weights/many-to-many/spm.model). Brings back the run with the higher greedy val BLEU (its
# float16 shards and config.json) and both runs' logs. Run from the repository root with gpudata/multi30k
# (the Multi30k files) carried along, and gpudata/spm.model where weights/ does not travel (the device tool
# sends at most 64 MiB). SMOKE=1 DEVICE=cpu MAX_STEPS=3 BUDGET_MIN=0.4 checks the script on a CPU.

export PYTHONUNBUFFERED=1
BUDGET_MIN=${BUDGET_MIN:-7.3}
DEADLINE=${DEADLINE:-555}
RUNS=${RUNS:-"m2m-384-long m2m-384-long-d02"}
OUT=${OUT:-/tmp/gpu-out}
T0=$(date +%s)
mkdir -p "$OUT" /tmp/gpu-configs
for r in $RUNS; do
  cfg=/tmp/gpu-configs/$r.toml
  [ -d ../shared/data/multi30k ] && cp configs/experiments/$r.toml "$cfg" ||
    sed 's#^dir = "../shared/data/multi30k"#dir = "gpudata/multi30k"#' configs/experiments/$r.toml > "$cfg"
  if [ -n "$SMOKE" ]; then
    sed -i 's/^eval_limit = 0/eval_limit = 8\ntrain_limit = 300/' "$cfg"
  fi
  spm=weights/many-to-many/spm.model
  [ -f $spm ] || spm=gpudata/spm.model
  mkdir -p runs/$r && cp $spm runs/$r/spm.model
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 -c "import torch, sentencepiece, sacrebleu, safetensors, tqdm; print('torch', torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
for r in $RUNS; do
  python3 - "$r" "$BUDGET_MIN" > "$OUT/$r.log" 2>&1 <<'PY' &
import logging, os, sys, time
from pathlib import Path
import torch
from model.train import Trainer
from model.train_config import load_train_config
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
name, budget = sys.argv[1], float(sys.argv[2]) * 60
cfg = load_train_config(f"/tmp/gpu-configs/{name}.toml")
t = Trainer(cfg, Path("runs") / name, torch.device(os.environ.get("DEVICE", "cuda")))
start = time.perf_counter()
t.run(int(os.environ.get("MAX_STEPS", "0")) or None, budget)
final = t.finish()
logging.info("DONE %s: %s after %.0f s (epochs %d, steps %d)", name, final, time.perf_counter() - start, t.epoch, t.step)
PY
done
while [ "$(jobs -rp | wc -l)" -gt 0 ] && [ $(( $(date +%s) - T0 )) -lt "$DEADLINE" ]; do
  sleep 5
  [ $(( ($(date +%s) - T0) % 60 )) -lt 5 ] && nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
done
jobs -rp | xargs -r kill
sleep 1
best="" best_bleu=-1
for r in $RUNS; do
  grep -E "epoch [0-9]+ step|checkpoint: valid|DONE|Error|error" "$OUT/$r.log" | tail -n 40
  cp runs/$r/log.jsonl "$OUT/$r.log.jsonl" 2>/dev/null
  if [ -f runs/$r/model/config.json ]; then
    bleu=$(python3 -c "import json,sys; t=json.load(open(sys.argv[1]))['training']; print(max(t['valid_bleu_greedy'].values()))" runs/$r/model/config.json)
    echo "$r final greedy val BLEU $bleu"
    if python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) > float(sys.argv[2]) else 1)" "$bleu" "$best_bleu"; then
      best=$r best_bleu=$bleu
    fi
  fi
done
if [ -n "$best" ]; then
  echo "bringing back $best ($best_bleu)"
  mkdir -p "$OUT/$best" && cp runs/$best/model/*.safetensors runs/$best/model/config.json "$OUT/$best/"
fi
ls -la "$OUT" "$OUT"/*/ 2>/dev/null
echo "total $(( $(date +%s) - T0 )) s"
