#!/usr/bin/env bash
# One prepared check for a GPU machine, under 8 minutes in all: the learner's train step and the
# Pallas LM-head kernels, timed on the GPU. Each part has its own time limit, so a slow part
# costs only its share and the parts after it still run; every log and JSON lands in OUTDIR.
#
#   bash benchmarks/gpu_check.sh [OUTDIR]        # from the repo root; OUTDIR default $OUT or
#                                                # runs/gpu_check
#   GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh  # a dry run of the same steps on a CPU, tiny
#                                                # sizes, kernels interpreted (checks the script)
#
# Parts (limits add up to 430 s, plus start-up):
#   env            nvidia-smi, jax's devices; stops here if jax sees no GPU (unless GPU_CHECK_CPU)
#   learner_74m    benchmarks/learner_throughput.py, its default model (d=768, 8 layers, 73.9M)
#   learner_head   the same with a head-heavy model (d=1024, 8 layers, vocab 151,936)
#   kernels        benchmarks/loss_kernel_gpu_check.py: Pallas vs reference values and gradients
#                  (fp32, bf16), then forward+backward time per size until its budget is spent
# Ends with the RESULT line of each part and one line `RESULT gpu_check parts=<n> ok=<n>`.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
# Not installed (a GPU machine with jax but no network for pip): the layout setup.py installs,
# kernels/, launch/ and configs/ inside the posttrain_jax namespace, as links in a temp dir.
if ! "$py" -c "import posttrain_jax.kernels" 2>/dev/null; then
  shim=$(mktemp -d)
  mkdir "$shim/posttrain_jax"
  for f in "$PWD"/posttrain_jax/*; do ln -s "$f" "$shim/posttrain_jax/"; done
  for d in kernels launch configs; do ln -s "$PWD/$d" "$shim/posttrain_jax/$d"; done
  export PYTHONPATH="$shim:$PYTHONPATH"
fi
cpu=${GPU_CHECK_CPU:-0}
parts=0
ok=0

part() {  # part NAME LIMIT_S CMD...: runs CMD with a time limit, its output to OUTDIR/NAME.log
  local name=$1 limit=$2 rc
  shift 2
  parts=$((parts + 1))
  echo "== $name (limit ${limit} s): $*"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  rc=${PIPESTATUS[0]}
  echo "$name exit $rc" | tee -a "$out/status.txt"
  if [ "$rc" -eq 0 ]; then ok=$((ok + 1)); fi
}

: >"$out/status.txt"
echo "== env"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  "$py" -c "import jax; print('jax', jax.__version__, jax.devices())"; } | tee "$out/env.log"
if [ "$cpu" != 1 ] && ! "$py" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')"; then
  echo "jax sees no GPU (backend: $("$py" -c 'import jax; print(jax.default_backend())')):" \
       "nothing to time; GPU_CHECK_CPU=1 runs the same steps on a CPU"
  exit 2
fi

if [ "$cpu" = 1 ]; then
  small=(--hidden 64 --layers 2 --vocab 512 --batch 2 --seq-len 64 --repeats 1)
  part learner_74m 120 "$py" benchmarks/learner_throughput.py "${small[@]}" --out "$out/learner_74m.json"
  part learner_head 120 "$py" benchmarks/learner_throughput.py "${small[@]}" --vocab 4096 \
    --out "$out/learner_head.json"
  part kernels 240 "$py" benchmarks/loss_kernel_gpu_check.py --interpret --vocab 4096 --budget-s 30
else
  part learner_74m 100 "$py" benchmarks/learner_throughput.py --batch 16 --seq-len 1024 \
    --out "$out/learner_74m.json"
  part learner_head 130 "$py" benchmarks/learner_throughput.py --hidden 1024 --layers 8 \
    --vocab 151936 --batch 8 --seq-len 1024 --out "$out/learner_head.json"
  part kernels 200 "$py" benchmarks/loss_kernel_gpu_check.py --budget-s 140
fi

echo
grep -h "^RESULT" "$out"/learner_74m.log "$out"/learner_head.log "$out"/kernels.log 2>/dev/null
echo "RESULT gpu_check parts=$parts ok=$ok"
[ "$ok" -eq "$parts" ]
