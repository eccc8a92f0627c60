#!/bin/bash
# posttrain_jax on a Cloud TPU VM pod slice (e.g. v5p-64: 8 hosts): the same command on every
# worker, each one process of one JAX job. No Pathways: plain multi-controller JAX, where
# jax.distributed finds the slice's hosts from the TPU VM's metadata (`--distributed`).
#
#   launch/tpu_pod.sh my-tpu us-east5-a --config=configs/qwen3.py:8b,v5p64 \
#       --config.model.path=/shared/Qwen3-8B --config.tasks.path=/shared/gsm8k/train.jsonl \
#       --workdir=/shared/runs/qwen3_8b_v5p64
#
# Arguments after the TPU name and zone go to launch/train.py unchanged. The repository must
# be at the same path on every worker (POSTTRAIN_JAX_DIR, default ~/posttrain_jax; `--setup`
# as the third argument copies this checkout there and installs it first), and the workdir on
# storage every worker sees (checkpoints are written by all of them into one directory).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 TPU_NAME ZONE [--setup] [launch/train.py flags ...]" >&2
  exit 2
fi
tpu=$1; zone=$2; shift 2
dir=${POSTTRAIN_JAX_DIR:-'~/posttrain_jax'}
ssh() { gcloud compute tpus tpu-vm ssh "$tpu" --zone="$zone" --worker=all --command="$1"; }
if [ "${1:-}" = "--setup" ]; then
  shift
  gcloud compute tpus tpu-vm scp --recurse --zone="$zone" --worker=all \
    "$(cd "$(dirname "$0")/.." && pwd)" "$tpu":"$dir"
  ssh "cd $dir && pip install -q -e . 'jax[tpu]'"
fi
args=$(printf '%q ' "$@")
# Every worker at once; a worker that dies takes the job down (its collectives fail on the others).
ssh "cd $dir && python launch/train.py --distributed $args"
