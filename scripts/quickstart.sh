#!/usr/bin/env bash
# The main job on a fresh CPU machine: create .venv, prepare the Shakespeare corpus, pretrain a
# tiny Llama-style base, retrofit it to 2x DMC (zero_out -> retrofit -> solidify), and print
# base vs DMC validation perplexity (eval mode, hard decisions) and the measured CR.
#   bash scripts/quickstart.sh            # everything lands in runs/quickstart/
# Knobs (environment): QS_PRETRAIN_STEPS, QS_RETROFIT_STEPS, QS_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -c "import torch" >/dev/null 2>&1 || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e .
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONWARNINGS=ignore

QS=${QS_DIR:-runs/quickstart}
PRETRAIN_STEPS=${QS_PRETRAIN_STEPS:-300}
RETROFIT_STEPS=${QS_RETROFIT_STEPS:-180}
mkdir -p "$QS"

echo "== 1/3 data: Shakespeare -> SentencePiece (4096) -> megatron indexed dataset"
[ -f "$QS/data/meta.json" ] || dmc data prepare --output "$QS/data" --vocab-size 4096 --quiet

common=(--config configs/models/tiny.yaml data.path="$QS/data" logging.eval_iters=16)
echo "== 2/3 pretrain the tiny base ($PRETRAIN_STEPS steps)"
dmc pretrain "${common[@]}" --json run_dir="$QS/base" schedule.pretrain_steps="$PRETRAIN_STEPS" \
  optim.lr=2e-3 optim.warmup_steps=20 optim.min_lr_ratio=0.1 checkpoint.save_interval=100 \
  | tail -n 1 > "$QS/base.json"

echo "== 3/3 retrofit to 2x DMC (zero_out 10, retrofit $RETROFIT_STEPS, solidify 40 steps)"
dmc retrofit "${common[@]}" --config configs/retrofit/cr2.yaml --json run_dir="$QS/dmc2" \
  checkpoint.load_base="$QS/base/checkpoints/pretrain" optim.lr=2e-3 \
  schedule.zero_out_steps=10 schedule.retrofit_steps="$RETROFIT_STEPS" schedule.solidify_steps=40 \
  checkpoint.save_interval=100 | tail -n 1 > "$QS/dmc2.json"

python - "$QS" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
root, wall = sys.argv[1], int(sys.argv[2])
base = json.load(open(f"{root}/base.json"))
dmc = json.load(open(f"{root}/dmc2.json"))
print()
print(f"{'model':<22}{'valid ppl':>12}{'measured CR':>14}")
print(f"{'base (vanilla)':<22}{base['valid_ppl']:>12.2f}{1.0:>14.2f}")
print(f"{'DMC, target 2x':<22}{dmc['valid_ppl']:>12.2f}{dmc['valid_cr']:>14.2f}")
print(f"wall time {wall // 60} min {wall % 60} s; checkpoints under {root}/dmc2/checkpoints "
      f"(cr_1.5, cr_2.0, solidify), metrics in {root}/dmc2/metrics.jsonl")
PY
