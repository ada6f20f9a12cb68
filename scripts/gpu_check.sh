#!/usr/bin/env bash
# One-command GPU validation kit: the `gpu` tests, then the decode, paged-kernel and train-step
# benchmarks, every log and JSON written into RESULTS_DIR with a summary. On a GPU the kernel
# steps also write the launch settings they found fastest into RESULTS_DIR/kernel_tuning.json
# (dmc/inference/kernels/tuning.py) and `decode_tuned` runs the decode benchmark again under
# them (DMC_KERNEL_TUNING): copy the file to dmc/inference/kernels/tunings/ to ship it.
#
#   bash scripts/gpu_check.sh RESULTS_DIR
#
# Made for an H100 / H200 machine with Python 3.12, torch 2.11 (CUDA 13), triton 3.6, pytest,
# numpy, pyyaml, psutil, tqdm and matplotlib but no megatron-core and no network. Fill a wheel
# folder beforehand, on a machine with network, in the repository root (`.whl/` is then ignored
# through .git/info/exclude; DMC_WHEELS names another folder):
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl "megatron-core==0.16.1" "sentencepiece==0.2.3"
#
# (the versions within pyproject.toml's pins; one version of each package, or pip refuses the
# folder). The script installs every wheel there with `pip install --no-index --no-deps --target
# SITE` (SITE = $TMPDIR/dmc-gpu-check-site unless DMC_SITE is set) and runs with
# PYTHONPATH=REPO:SITE, so `dmc` is imported from this checkout. Without a wheel folder the
# installed packages are used.
#
# Without CUDA it still runs end to end: the GPU tests are skipped and the benchmarks run their CPU
# presets. Steps that fail are recorded in the summary and the script goes on; it exits 1 when a
# step failed, 2 on bad usage.
#
# Files in RESULTS_DIR: environment.txt, install.log, gpu_tests.log, gpu_tests.xml (JUnit),
# decode_throughput.{log,json}, paged_kernel.{log,json}, write_kernel.{log,json},
# decode_model.{log,json}, kernel_tuning.json, decode_tuned.{log,json}, train_step.{log,json},
# steps.tsv, summary.txt, summary.json. PYTHON (default python3) picks the interpreter.
# DMC_CHECK_STEPS runs some steps only (of, in the order they run: gpu_tests train_step
# decode_throughput decode_model paged_kernel write_kernel decode_tuned; the short train step
# second, so a deadline does not leave it out), e.g. one per call where a command's time is
# limited; steps.tsv keeps the earlier calls' records (the summary reads the newest of each
# step). decode_tuned runs where kernel_tuning.json exists (from this call or an earlier one into
# the same RESULTS_DIR); decode_model where DMC_CHECK_MODEL names a trained checkpoint (a run or
# checkpoint folder or an inference .pt, e.g. the quickstart's DMC 2x as runs/quickstart/dmc2.pt,
# docs/gpu_validation.md "GPU validation kit"): the decode benchmark of vanilla against the model's
# own decisions on its shape (--prompt-len 128 --gen-len 64 --steady 32 --budget-mib 64;
# DMC_MODEL_ARGS appends flags).
#
# For a leased machine whose minutes are counted: DMC_TIMEOUT_<step> (e.g. DMC_TIMEOUT_gpu_tests
# =150) stops a step after that many seconds (exit 124 in the summary; the others still run);
# DMC_CHECK_QUICK=1 shortens the protocols (decode: 512 generated tokens and the last 256 steps
# instead of 2048 and 512, modes vanilla, DMC 4x and DMS 4x, each also overlapped;
# paged and write kernels: 20 iterations; train step: 1 warm-up + 4 steps);
# DMC_TEST_WORKERS=N runs the GPU tests in N pytest-xdist processes (where xdist is installed),
# which compile their FlexAttention and Triton kernels side by side; DMC_DECODE_MODES (e.g.
# vanilla,dmc:2,dmc:8) replaces the decode step's modes; DMC_TEST_PATHS (default tests) the
# test folders or files the GPU tests are collected from (e.g. tests/inference, for a call
# that checks decode changes only); DMC_TRAIN_BACKENDS, DMC_TRAIN_ACCUMULATE,
# DMC_TRAIN_COMPILE and DMC_TRAIN_DELAYS the train step's --backends, --accumulate, --compile
# and --merge-delays (e.g. flex-transposed, triton, off and 0: one DMC row; both: a twin row
# with dmc.compile_elementwise; 0,16: each DMC row also with delayed merging, d = 16).
#
# For one command under a hard time limit (a lease whose calls are killed at N seconds, taking
# every file not yet copied out with them): DMC_CHECK_DEADLINE=SECONDS, counted from the script's
# start, caps every step's time to what is left of it less DMC_CHECK_RESERVE seconds (default 15:
# the summary and the archive) and skips a step when fewer than DMC_CHECK_MIN_STEP seconds
# (default 20) would be left for it (recorded as "skipped" in steps.tsv, a failed step in the
# summary); DMC_CHECK_ARCHIVE=FILE.tgz writes RESULTS_DIR as a gzipped tarball after every step
# and at the end (each time to a temporary name, then renamed: a kill leaves the last whole one),
# for a machine that hands back only a few files.
set -uo pipefail

if [ "$#" -ne 1 ] || [ -z "$1" ]; then
  echo "usage: bash scripts/gpu_check.sh RESULTS_DIR" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1" || { echo "gpu_check: RESULTS_DIR $1 cannot be created" >&2; exit 2; }
RESULTS=$(cd "$1" && pwd)
PYTHON=${PYTHON:-python3}
WHEELS=${DMC_WHEELS:-$ROOT/.whl}
SITE=${DMC_SITE:-${TMPDIR:-/tmp}/dmc-gpu-check-site}
STEPS="$RESULTS/steps.tsv"
DEADLINE=${DMC_CHECK_DEADLINE:-}
RESERVE=${DMC_CHECK_RESERVE:-15}
MIN_STEP=${DMC_CHECK_MIN_STEP:-20}
ARCHIVE=${DMC_CHECK_ARCHIVE:-}
for setting in DEADLINE RESERVE MIN_STEP; do
  case ${!setting} in
    ''|*[!0-9]*)
      if [ "$setting" != DEADLINE ] || [ -n "$DEADLINE" ]; then
        echo "gpu_check: DMC_CHECK_$setting: expected a whole number of seconds, got" \
          "'${!setting}'" >&2
        exit 2
      fi ;;
  esac
done
if [ -n "$ARCHIVE" ]; then
  case $ARCHIVE in
    *.tgz|*.tar.gz) ;;
    *) echo "gpu_check: DMC_CHECK_ARCHIVE: expected a FILE.tgz or FILE.tar.gz, got '$ARCHIVE'" >&2
       exit 2 ;;
  esac
  folder=$(dirname "$ARCHIVE")
  mkdir -p "$folder" || {
    echo "gpu_check: DMC_CHECK_ARCHIVE: the folder $folder cannot be created" >&2; exit 2; }
  ARCHIVE="$(cd "$folder" && pwd)/$(basename "$ARCHIVE")"
  case $ARCHIVE in
    "$RESULTS"/*) echo "gpu_check: DMC_CHECK_ARCHIVE: $ARCHIVE lies inside RESULTS_DIR, which it" \
                    "archives; name a file elsewhere" >&2; exit 2 ;;
  esac
fi
ALL_STEPS="gpu_tests train_step decode_throughput decode_model paged_kernel write_kernel \
decode_tuned"
SELECTED=${DMC_CHECK_STEPS:-$ALL_STEPS}
for step in $SELECTED; do
  case " $ALL_STEPS " in
    *" $step "*) ;;
    *) echo "gpu_check: DMC_CHECK_STEPS: unknown step '$step'; accepted: $ALL_STEPS" >&2; exit 2 ;;
  esac
done
if [ -n "${DMC_CHECK_MODEL:-}" ] && [ ! -e "$DMC_CHECK_MODEL" ]; then
  echo "gpu_check: DMC_CHECK_MODEL: '$DMC_CHECK_MODEL' does not exist; accepted: a trained" \
    "checkpoint (a run or checkpoint folder, or an inference .pt)" >&2
  exit 2
fi
for path in ${DMC_TEST_PATHS:-tests}; do
  case $path in
    tests|tests/*) [ -e "$ROOT/$path" ] && continue ;;
  esac
  echo "gpu_check: DMC_TEST_PATHS: '$path' is not a test folder or file of this checkout;" \
    "accepted: tests or paths below it, e.g. tests/inference" >&2
  exit 2
done

# archive: RESULTS as the tarball DMC_CHECK_ARCHIVE names (nothing without one).
archive() {
  [ -n "$ARCHIVE" ] || return 0
  tar czf "$ARCHIVE.partial" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" \
    && mv -f "$ARCHIVE.partial" "$ARCHIVE"
}

# run NAME CMD...: runs CMD with its output in RESULTS/NAME.log, records status and seconds
# (a step DMC_CHECK_STEPS leaves out does not run; one the deadline leaves no time for is
# recorded as skipped), then archives the results.
run() {
  local name=$1; shift
  case " install $SELECTED " in *" $name "*) ;; *) return 0 ;; esac
  local start=$SECONDS limit_var="DMC_TIMEOUT_$name"
  local limit=${!limit_var:-}
  if [ -n "$DEADLINE" ]; then
    local left=$((DEADLINE - SECONDS - RESERVE))
    if [ "$left" -lt "$MIN_STEP" ]; then
      printf '%s\tskipped\t0\n' "$name" >> "$STEPS"
      echo "== $name: skipped, ${left} s left before DMC_CHECK_DEADLINE's reserve"
      archive
      return 0
    fi
    if [ -z "$limit" ] || [ "$limit" -gt "$left" ]; then limit=$left; fi
  fi
  echo "== $name: $*${limit:+ (at most $limit s)}"
  # a previous call's results into this folder must not pass for this step's
  rm -f "$RESULTS/$name.json" "$RESULTS/$name.xml"
  if [ -n "$limit" ]; then
    timeout --kill-after=10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  else
    "$@" > "$RESULTS/$name.log" 2>&1
  fi
  local status=$?
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" >> "$STEPS"
  echo "   exit $status after $((SECONDS - start)) s (log: $RESULTS/$name.log)"
  archive
}

if compgen -G "$WHEELS/*.whl" > /dev/null; then
  run install "$PYTHON" -m pip install --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "gpu_check: no wheels in $WHEELS; using the installed packages" | tee "$RESULTS/install.log"
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

"$PYTHON" - > "$RESULTS/environment.txt" 2>&1 <<'EOF'
import platform, sys, warnings
warnings.filterwarnings("ignore")
import torch, triton
print("python", sys.version.split()[0], platform.machine())
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs")
else:
    print("device: no CUDA (GPU tests skip, benchmarks run their CPU presets)")
import megatron.core
print("megatron-core", megatron.core.__version__, "from", megatron.core.__path__[0])
EOF
env_status=$?
cat "$RESULTS/environment.txt"
if [ "$env_status" -ne 0 ]; then
  echo "gpu_check: torch, triton or megatron-core cannot be imported (see environment.txt)" >&2
  archive
  exit 1
fi
CUDA=$("$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))")

cd "$ROOT" || exit 1
WORKERS=()
if [ "${DMC_TEST_WORKERS:-1}" -gt 1 ] && "$PYTHON" -c "import xdist" 2>/dev/null; then
  WORKERS=(-n "$DMC_TEST_WORKERS")
fi
QUICK_DECODE=() QUICK_KERNEL=() QUICK_TRAIN=()
if [ "${DMC_CHECK_QUICK:-0}" = 1 ]; then
  QUICK_DECODE=(--gen-len 512 --steady 256 --modes vanilla,dmc:4,dms:4)
  QUICK_KERNEL=(--iters 20)
  QUICK_TRAIN=(--steps 4 --warmup 1)
fi
DECODE_MODES=()
if [ -n "${DMC_DECODE_MODES:-}" ]; then  # after QUICK_DECODE's: the last --modes wins
  DECODE_MODES=(--modes "$DMC_DECODE_MODES")
fi
read -r -a MODEL_ARGS <<< "${DMC_MODEL_ARGS:-}"
# decode_model: the trained checkpoint DMC_CHECK_MODEL names (unset: the step is not run)
decode_model() {
  if [ -n "${DMC_CHECK_MODEL:-}" ]; then
    run decode_model "$PYTHON" benchmarks/decode_throughput.py "$@" --model "$DMC_CHECK_MODEL" \
      --modes vanilla,model --prompt-len 128 --gen-len 64 --steady 32 --budget-mib 64 \
      "${MODEL_ARGS[@]}" --out "$RESULTS/decode_model.json"
  elif [[ " $SELECTED " == *" decode_model "* ]]; then
    echo "== decode_model: not run, DMC_CHECK_MODEL names no trained checkpoint"
  fi
}
TRAIN_ROWS=()
if [ -n "${DMC_TRAIN_BACKENDS:-}" ]; then
  TRAIN_ROWS+=(--backends "$DMC_TRAIN_BACKENDS")
fi
if [ -n "${DMC_TRAIN_ACCUMULATE:-}" ]; then
  TRAIN_ROWS+=(--accumulate "$DMC_TRAIN_ACCUMULATE")
fi
if [ -n "${DMC_TRAIN_COMPILE:-}" ]; then
  TRAIN_ROWS+=(--compile "$DMC_TRAIN_COMPILE")
fi
if [ -n "${DMC_TRAIN_DELAYS:-}" ]; then
  TRAIN_ROWS+=(--merge-delays "$DMC_TRAIN_DELAYS")
fi
# a test module that cannot be imported there (another extra missing) must not stop the GPU
# tests: it is counted as an error in gpu_tests.xml and the summary
# -v: a line per test as it ends, so a run stopped by its time limit still tells which passed
read -r -a TEST_PATHS <<< "${DMC_TEST_PATHS:-tests}"
run gpu_tests "$PYTHON" -m pytest -m gpu -p no:cacheprovider -v -rs --durations 15 \
  "${WORKERS[@]}" --continue-on-collection-errors --junitxml "$RESULTS/gpu_tests.xml" \
  "${TEST_PATHS[@]}"

if [ "$CUDA" = 1 ]; then
  run train_step "$PYTHON" benchmarks/train_step.py --layers 16 --hidden 2048 --heads 16 \
    --groups 16 --ffn 5504 --vocab 32000 --seq 2048 --batch 4 "${QUICK_TRAIN[@]}" \
    "${TRAIN_ROWS[@]}" --by-site 8 --profile 30 --copy-sites 25 \
    --out "$RESULTS/train_step.json"
  DECODE=("$PYTHON" benchmarks/decode_throughput.py --preset gpu --cuda-graphs --overlap both
          --profile "${QUICK_DECODE[@]}" "${DECODE_MODES[@]}")
  run decode_throughput "${DECODE[@]}" --out "$RESULTS/decode_throughput.json"
  decode_model --preset gpu --cuda-graphs
  # one layer of the decode preset's cache: vanilla's batch (16 KV heads of 128 channels, 2560
  # slots: 2048 + 512 tokens), then DMC 4x's (4x the sequences, heads 4x shorter)
  run paged_kernel "$PYTHON" benchmarks/paged_kernel.py --sweep --compare-cr 4 --batch 36 \
    --q-heads 16 --kv-heads 16 --length 2560 "${QUICK_KERNEL[@]}" \
    --write-tuning "$RESULTS/kernel_tuning.json" --out "$RESULTS/paged_kernel.json"
  run write_kernel "$PYTHON" benchmarks/write_kernel.py "${QUICK_KERNEL[@]}" \
    --write-tuning "$RESULTS/kernel_tuning.json" --out "$RESULTS/write_kernel.json"
  if [ -f "$RESULTS/kernel_tuning.json" ]; then
    run decode_tuned env DMC_KERNEL_TUNING="$RESULTS/kernel_tuning.json" "${DECODE[@]}" \
      --out "$RESULTS/decode_tuned.json"
  elif [[ " $SELECTED " == *" decode_tuned "* ]]; then
    echo "== decode_tuned: not run, no kernel_tuning.json (paged_kernel and write_kernel write it)"
  fi
else
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  run train_step "$PYTHON" benchmarks/train_step.py --layers 2 --hidden 128 --heads 4 \
    --ffn 256 --vocab 512 --seq 128 --batch 2 --steps 3 --warmup 1 "${TRAIN_ROWS[@]}" \
    --by-site 8 --profile 12 --copy-sites 8 --out "$RESULTS/train_step.json"
  run decode_throughput "$PYTHON" benchmarks/decode_throughput.py --preset cpu \
    "${DECODE_MODES[@]}" --out "$RESULTS/decode_throughput.json"
  decode_model --preset cpu
  run paged_kernel "$PYTHON" benchmarks/paged_kernel.py --cpu-reference --batch 4 --q-heads 8 \
    --kv-heads 2 --head-dim 64 --length 512 --iters 5 --compare-cr 4 \
    --out "$RESULTS/paged_kernel.json"
  run write_kernel "$PYTHON" benchmarks/write_kernel.py --batch 8 --kv-heads 4 --head-dim 64 \
    --length 256 --iters 5 --out "$RESULTS/write_kernel.json"
fi

"$PYTHON" "$ROOT/scripts/gpu_check_summary.py" "$RESULTS"
summary_status=$?
archive
exit "$summary_status"
