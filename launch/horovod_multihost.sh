#!/usr/bin/env bash
# Horovod data parallel across the hosts of a hostfile, started by horovodrun (over ssh).
#
#   launch/horovod_multihost.sh HOSTFILE [tfbig-train flags...]
#   launch/horovod_multihost.sh launch/hostfile.example --preset=125m --batch_size=512 \
#       --model_dir=/shared/runs/gpt-125m
#
# HOSTFILE lines are "HOSTNAME slots=N" (see launch/hostfile.example); the job runs the sum of
# the slots as processes. Gloo by default; HOROVOD_CONTROLLER=mpi uses MPI instead (Horovod
# built with MPI). NIC=eth0 pins the network interface(s) Horovod uses between hosts.
set -euo pipefail

if (( $# < 1 )) || [[ ! -f "$1" ]]; then
  echo "usage: horovod_multihost.sh HOSTFILE [tfbig-train flags...];" \
       "hostfile ${1:-(none)} not found" >&2
  exit 2
fi
hostfile=$1
shift
np=$(awk '!/^[[:space:]]*(#|$)/ {  # "host slots=N"; a host without slots= counts 1
           n = 1; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) n = substr($i, 7); total += n
         } END { print total + 0 }' "$hostfile")
if (( np < 1 )); then
  echo "horovod_multihost.sh: $hostfile lists no hosts" >&2
  exit 2
fi

command=(horovodrun -np "$np" -hostfile "$hostfile" "--${HOROVOD_CONTROLLER:-gloo}")
[[ -n "${NIC:-}" ]] && command+=(--network-interfaces "$NIC")
command+=(tfbig-train --strategy=horovod "$@")
echo "+ ${command[*]}" >&2
[[ -n "${DRY_RUN:-}" ]] && exit 0
exec "${command[@]}"
