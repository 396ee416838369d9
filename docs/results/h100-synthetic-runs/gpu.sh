#!/bin/bash
# The device driver of 2026-11-27 (H100): four Trainer runs side by side on the GPU under one time budget,
# each brought back as a tar of its model folder and log; RUNS names configs/experiments/*.toml. Run from the
# repository root with synthetic/ (model.distill output and the Multi30k files) carried along.

export PYTHONUNBUFFERED=1
BUDGET_MIN=${BUDGET_MIN:-7.0}
DEADLINE=${DEADLINE:-515}
RUNS=${RUNS:-"en-de-kd en-de-kd-bt en-de-kd-bt-pivot de-en-kd-bt"}
T0=$(date +%s)
if [ ! -d ../shared/data/multi30k ]; then
  mkdir -p ../shared/data/multi30k && cp synthetic/multi30k/* ../shared/data/multi30k/ ||
    sed -i 's#^dir = "../shared/data/multi30k"#dir = "synthetic/multi30k"#' configs/experiments/*.toml
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, sentencepiece, sacrebleu, safetensors; print('torch', torch.__version__, torch.cuda.get_device_name())"
for r in $RUNS; do
  python3 - "$r" "$BUDGET_MIN" > "$OUT/$r.log" 2>&1 <<'PY' &
import logging, os, sys, time
from pathlib import Path
import torch
from model.train import Trainer
from model.train_config import load_train_config
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
name, budget = sys.argv[1], float(sys.argv[2]) * 60
cfg = load_train_config(f"configs/experiments/{name}.toml")
t = Trainer(cfg, Path("runs") / name, torch.device(os.environ.get("DEVICE", "cuda")))
start = time.perf_counter()
steps = int(os.environ.get("MAX_STEPS", "0")) or None
t.run(steps, budget)
final = t.finish()
logging.info("DONE %s: %s after %.0f s (epochs %d, steps %d)", name, final, time.perf_counter() - start, t.epoch, t.step)
PY
done
while [ "$(jobs -rp | wc -l)" -gt 0 ] && [ $(( $(date +%s) - T0 )) -lt "$DEADLINE" ]; do sleep 5; done
jobs -rp | xargs -r kill
sleep 2
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
for r in $RUNS; do
  tail -n 3 "$OUT/$r.log"
  [ -f runs/$r/model/model.safetensors ] && tar -cf "$OUT/$r.tar" -C runs/$r model log.jsonl
done
ls -la "$OUT"
echo "total $(( $(date +%s) - T0 )) s"
