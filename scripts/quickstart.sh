#!/usr/bin/env bash
# The main job on a fresh CPU machine: create .venv, prepare the Shakespeare corpus, pretrain a
# tiny Llama-style base, then three runs with the SAME steps, data order and LR from it: the
# control (vanilla attention up-trained), DMC 2x (zero_out -> retrofit -> solidify) and GQA 2x
# (KV heads mean-pooled, up-trained). Prints their validation perplexity and measured CR, then
# compares them and four KV policies at 2x with the real caches (`dmc eval compare`: decoded-token
# perplexity, KL and top-1 agreement against the control, needles, slots and memory CR).
#   bash scripts/quickstart.sh            # everything lands in runs/quickstart/
# Knobs (environment): QS_PRETRAIN_STEPS, QS_RETROFIT_STEPS, QS_DIR.
# The full-size comparison (DMC 2/4/8x, GQA, nine policies) is benchmarks/retrofit_quality.py.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
bash scripts/install_torch.sh
python -m pip install -q -e .
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONWARNINGS=ignore

QS=${QS_DIR:-runs/quickstart}
PRETRAIN_STEPS=${QS_PRETRAIN_STEPS:-300}
RETROFIT_STEPS=${QS_RETROFIT_STEPS:-180}
mkdir -p "$QS"

echo "== 1/5 data: Shakespeare -> SentencePiece (4096) -> megatron indexed dataset"
[ -f "$QS/data/meta.json" ] || dmc data prepare --output "$QS/data" --vocab-size 4096 --quiet

common=(--config configs/models/tiny.yaml data.path="$QS/data" logging.eval_iters=16)
echo "== 2/5 pretrain the tiny base ($PRETRAIN_STEPS steps)"
dmc pretrain "${common[@]}" --json run_dir="$QS/base" schedule.pretrain_steps="$PRETRAIN_STEPS" \
  optim.lr=2e-3 optim.warmup_steps=20 optim.min_lr_ratio=0.1 checkpoint.save_interval=100 \
  | tail -n 1 > "$QS/base.json"

budget=(optim.lr=2e-3 schedule.zero_out_steps=10 schedule.retrofit_steps="$RETROFIT_STEPS"
        schedule.solidify_steps=40 checkpoint.save_interval=100)
steps=$((RETROFIT_STEPS + 50))
echo "== 3/5 three runs of $steps steps each from the base: control, DMC 2x, GQA 2x"
dmc retrofit "${common[@]}" --config configs/retrofit/cr2.yaml --json run_dir="$QS/control" \
  checkpoint.load_base="$QS/base/checkpoints/pretrain" dmc.enabled=false "${budget[@]}" \
  | tail -n 1 > "$QS/control.json"
dmc retrofit "${common[@]}" --config configs/retrofit/cr2.yaml --json run_dir="$QS/dmc2" \
  checkpoint.load_base="$QS/base/checkpoints/pretrain" "${budget[@]}" \
  | tail -n 1 > "$QS/dmc2.json"
[ -f "$QS/gqa2_init/state.json" ] || dmc baseline gqa --checkpoint "$QS/base/checkpoints/pretrain" \
  --num-query-groups 4 --output "$QS/gqa2_init" > /dev/null
dmc retrofit "${common[@]}" --config configs/retrofit/gqa2.yaml --json run_dir="$QS/gqa2" \
  model.num_query_groups=4 checkpoint.load_base="$QS/gqa2_init" "${budget[@]}" \
  | tail -n 1 > "$QS/gqa2.json"

echo "== 4/5 compare at 2x with the real caches: control, base, DMC, GQA, H2O, TOVA, SnapKV," \
  "StreamingLLM"
dmc eval compare --control "$QS/control/checkpoints/solidify" \
  --base "$QS/base/checkpoints/pretrain" \
  --dmc "$QS/dmc2/checkpoints/solidify" --gqa "$QS/gqa2/checkpoints/solidify" \
  --policies h2o,tova,snapkv,streamingllm --crs 2 --data "$QS/data" --seq-len 256 \
  --num-sequences 8 --prefill-fraction 0.5 --needle-lengths 64,128,256 --needles-per-cell 2 \
  --output "$QS/compare" > "$QS/compare.log"

echo "== 5/5 summary"
python - "$QS" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
root, wall = sys.argv[1], int(sys.argv[2])
rows = [("base (pretrained)", "base", 1.0), ("control (vanilla, same steps)", "control", 1.0),
        ("DMC, target 2x", "dmc2", None), ("GQA, 8 -> 4 KV heads", "gqa2", 2.0)]
print()
print(f"{'model':<32}{'valid ppl':>12}{'measured CR':>14}")
for label, name, cr in rows:
    run = json.load(open(f"{root}/{name}.json"))
    print(f"{label:<32}{run['valid_ppl']:>12.2f}{cr or run['valid_cr']:>14.2f}")
print()
print("dmc eval compare (8 x 256 tokens, the last 128 decoded token by token and scored; "
      "30 needles):")
print(json.load(open(f"{root}/compare/compare.json"))["table"])
print(f"wall time {wall // 60} min {wall % 60} s; checkpoints under {root}/dmc2/checkpoints "
      f"(cr_1.5, cr_2.0, solidify), metrics in {root}/dmc2/metrics.jsonl, comparison in "
      f"{root}/compare (compare.json, compare.md, compare.png)")
PY
