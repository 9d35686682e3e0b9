#!/usr/bin/env bash
# Horovod data parallel on this host: NUM_PROCS processes of tfbig-train --strategy=horovod,
# started by horovodrun over Gloo (no MPI, no ssh).
#
#   launch/horovod_local.sh [NUM_PROCS] [tfbig-train flags...]
#   launch/horovod_local.sh 2 --preset=tiny --max_steps=200 --model_dir=runs/hvd
#
# NUM_PROCS defaults to the number of GPUs (one process per GPU; each pins GPU local_rank), or
# 2 without GPUs. On CPU every process gets cores / NUM_PROCS threads so they don't oversubscribe.
# --batch_size stays the global batch: each process trains batch_size / NUM_PROCS per step.
set -euo pipefail

gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then
  np=$1
  shift
elif (( gpus > 0 )); then
  np=$gpus
else
  np=2
fi
if (( np < 1 )); then
  echo "horovod_local.sh: NUM_PROCS must be at least 1, got $np" >&2
  exit 2
fi
if (( gpus > 0 && np > gpus )); then
  echo "horovod_local.sh: $np processes but $gpus GPUs; each process needs its own GPU" >&2
  exit 2
fi
if (( gpus == 0 )); then
  threads=$(( $(nproc) / np ))
  (( threads >= 1 )) || threads=1
  export TF_NUM_INTRAOP_THREADS=${TF_NUM_INTRAOP_THREADS:-$threads}
  export TF_NUM_INTEROP_THREADS=${TF_NUM_INTEROP_THREADS:-1}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}
fi

command=(horovodrun -np "$np" -H "localhost:$np" --gloo tfbig-train --strategy=horovod "$@")
echo "+ ${command[*]}" >&2
[[ -n "${DRY_RUN:-}" ]] && exit 0
exec "${command[@]}"
