#!/usr/bin/env bash
# The same Horovod job started by Open MPI's mpirun instead of horovodrun, where MPI is
# installed and Horovod was built with it (HOROVOD_WITH_MPI=1; `horovodrun --check-build`).
#
#   launch/mpirun.sh HOSTFILE [tfbig-train flags...]    # hosts as in launch/hostfile.example
#   launch/mpirun.sh localhost:2 [tfbig-train flags...] # or host:slots[,host:slots...]
#
# The options are those of the Horovod docs: one process per slot, no core binding (TensorFlow
# manages its threads), environment forwarded, TCP between hosts. mpirun ends the whole job
# when any rank exits with an error. NIC=eth0 restricts MPI and NCCL to that interface.
set -euo pipefail

if (( $# < 1 )); then
  echo "usage: mpirun.sh HOSTFILE|host:slots[,host:slots...] [tfbig-train flags...]" >&2
  exit 2
fi
hosts=$1
shift
if [[ -f "$hosts" ]]; then
  np=$(awk '!/^[[:space:]]*(#|$)/ {  # "host slots=N"; a host without slots= counts 1
           n = 1; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) n = substr($i, 7); total += n
         } END { print total + 0 }' "$hosts")
  where=(-hostfile "$hosts")
else
  np=$(tr ',' '\n' <<< "$hosts" |
       awk -F: '{ total += ($2 == "" ? 1 : $2) } END { print total + 0 }')
  where=(-H "$hosts")
fi
if (( np < 1 )); then
  echo "mpirun.sh: no processes in $hosts" >&2
  exit 2
fi

command=(mpirun -np "$np" "${where[@]}" -bind-to none -map-by slot
         -x LD_LIBRARY_PATH -x PATH -x PYTHONPATH -x NCCL_DEBUG=WARN
         -mca pml ob1 -mca btl ^openib)
if [[ -n "${NIC:-}" ]]; then
  command+=(-mca btl_tcp_if_include "$NIC" -x NCCL_SOCKET_IFNAME="$NIC")
fi
command+=(tfbig-train --strategy=horovod "$@")
echo "+ ${command[*]}" >&2
[[ -n "${DRY_RUN:-}" ]] && exit 0
if ! command -v mpirun > /dev/null; then
  echo "mpirun.sh: mpirun not found; install Open MPI or use" \
       "launch/horovod_multihost.sh (Gloo)" >&2
  exit 127
fi
exec "${command[@]}"
