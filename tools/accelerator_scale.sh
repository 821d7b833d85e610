#!/usr/bin/env bash
# The CPU recipe (configs/smollm2.yaml) at many times its compute, on one accelerator, in one budgeted run:
# what τ the default recipe reaches when compute is no longer the limit, and the engine's K-flat curve there.
#
#   tools/accelerator_scale.sh OUT_DIR [BUDGET_SECONDS]
#
# Runs from the repository root with an interpreter that has jax (with its accelerator plugin) and this project's
# runtime dependencies importable (PYTHON, default python3). Stages, each with its own time limit so one failure
# leaves the others' results:
#   1. with FEATURES=offline only: `dflash data capture --config smollm2` (the default, online, computes the
#      target's features inside each train step on the accelerator: no feature files to write and stream)
#   2. benchmarks/engine_throughput.py: verify cost over K (the K-flat curve) and propose cost, B = 1 and 8
#   3. a 30-step probe of `dflash train` at BATCH x ANCHORS to time a step, then `dflash train` for as many steps
#      as the budget leaves (the recipe's schedule over that many steps; compute multiple printed against the
#      recipe's 2,600 steps x 8 rows x 64 anchors)
#   4. benchmarks/drafter_tau.py on the 80 held-out prompts: the shipped drafter beside this run's
# Results go to OUT_DIR (log.txt with each stage's tail, kflat.txt, benchmarks.md and the study page as the
# scripts' --write left them, probe.jsonl, train.jsonl, tau.json); whole stage outputs to STAGES (/tmp/accel-stages).
set -u
OUT_DIR=${1:?usage: tools/accelerator_scale.sh OUT_DIR [BUDGET_SECONDS]}
BUDGET=${2:-540}
PY=${PYTHON:-python3}
BATCH=${BATCH:-256}
ANCHORS=${ANCHORS:-32}
RUN=${RUN:-runs/accel}
STAGES=${STAGES:-/tmp/accel-stages}
mkdir -p "$OUT_DIR" "$STAGES"
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}
# grain worker processes must not each take most of the accelerator's memory
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
T0=$(date +%s)
now() { echo $(( $(date +%s) - T0 )); }
log() { echo "[$(now) s] $*" | tee -a "$OUT_DIR/log.txt"; }
left() { echo $(( BUDGET - $(now) )); }
stage() {  # stage NAME SECONDS CMD...: run with a limit, keep the output's tail in the log
  local name=$1 limit=$(( $2 * ${LIMIT_SCALE:-1} )); shift 2
  log "start $name (limit ${limit} s)"
  timeout "$limit" "$@" > "$STAGES/$name.out" 2>&1
  local rc=$?
  tail -n 40 "$STAGES/$name.out" | tr '\r' '\n' | tail -n 40 >> "$OUT_DIR/log.txt"
  log "end $name rc=$rc"
  return $rc
}
FEATURES=${FEATURES:-online}  # online: the target runs inside the train step (no capture, no feature I/O; rows unpacked)
COMMON=(train.wandb=disabled data.dir="$RUN/data" data.features="$FEATURES" ${EXTRA:-})  # EXTRA: more overrides (a smoke run: data.max_examples=64)

log "devices: $($PY -c 'import jax; print(jax.__version__, jax.devices())' 2>&1 | tail -1)"
if [ "$FEATURES" = offline ]; then
  stage capture 200 $PY -m dflash.launch.cli data capture --config smollm2 "${COMMON[@]}" data.capture_batch_size=${CAPTURE_BATCH:-64}
fi
stage kflat 120 $PY benchmarks/engine_throughput.py --write \
  ${KFLAT:---ks 1 2 4 8 16 32 64 --batches 1 8 --propose-ks 4 16 --prompts 1 --new-tokens 32 --repeats 5}
cp "$STAGES/kflat.out" "$OUT_DIR/kflat.txt"; cp docs/benchmarks.md "$OUT_DIR/benchmarks.md"

[ "$FEATURES" = online ] && COMMON+=(data.pack=0)
TRAIN=("${COMMON[@]}" train.batch_size="$BATCH" train.num_anchors="$ANCHORS" train.eval_every=0
       train.log_every=10 --loader-workers=8)
stage probe 120 $PY -m dflash.launch.cli train --config smollm2 "${TRAIN[@]}" train.run_dir="$RUN-probe" \
  train.steps=20 train.save_every=1000
STEPS=$($PY - "$RUN-probe/metrics.jsonl" "$(left)" "$BATCH" "$ANCHORS" "${MAX_STEPS:-1000000}" <<'EOF'
import json, sys
path, left, batch, anchors = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rates = [r["block_tokens_per_s"] for r in map(json.loads, open(path)) if "block_tokens_per_s" in r]
step_s = batch * anchors * 4 / rates[-1]
train_s = left - 110 - 40  # the tau stage, then the step's compile and the checkpoints
print(max(20, min(int(sys.argv[5]), int(train_s / step_s))))
EOF
)
log "probe: steps for the budget = ${STEPS:-?} (compute = steps x $BATCH x $ANCHORS / (2600 x 8 x 64) of the recipe)"
STEPS=${STEPS:-500}
stage train $(( $(left) - 100 )) $PY -m dflash.launch.cli train --config smollm2 "${TRAIN[@]}" train.run_dir="$RUN" \
  train.steps="$STEPS" train.save_every=$(( STEPS / 4 + 1 )) train.warmup_frac=0.02
cp "$RUN/metrics.jsonl" "$OUT_DIR/train.jsonl"; cp "$RUN-probe/metrics.jsonl" "$OUT_DIR/probe.jsonl"
# a run killed at its limit still has its last checkpoint only if it reached save_every; say which step tau measures
log "checkpoints: $(ls "$RUN" 2>/dev/null | tr '\n' ' ')"
stage tau $(( $(left) > 60 ? $(left) : 60 )) $PY benchmarks/drafter_tau.py --config smollm2 --per-set ${PER_SET:-16} \
  --drafter shipped=data/assets/drafters/smollm2-dflash --drafter accel="$RUN" --json "$OUT_DIR/tau.json" --write
cp docs/studies/README.md "$OUT_DIR/studies_index.md"; cp "$(ls -t docs/studies/*.md | grep -v README | head -1)" "$OUT_DIR/study.md"
log "done"
