#!/usr/bin/env bash
# Elastic Horovod: tfbig-train --strategy=horovod --elastic between MIN_NP and MAX_NP processes
# on the hosts a discovery script prints (one "host:slots" line each; re-run every second).
# Ranks may die (spot capacity) or join; the run rolls back to the last in-memory commit and
# goes on with the world it has. Over Gloo; hosts other than this one need passwordless ssh.
#
#   launch/horovod_elastic.sh MIN_NP MAX_NP DISCOVERY_SCRIPT [tfbig-train flags...]
#   launch/horovod_elastic.sh 1 4 ./discover_hosts.sh --preset=125m --batch_size=512 --max_steps=100000 --model_dir=/shared/runs/125m
#
# --batch_size stays the global batch whatever the world: it must be divisible by every world
# size in MIN_NP..MAX_NP times --grad_accum_steps.
set -euo pipefail

if (( $# < 3 )) || ! [[ "$1" =~ ^[0-9]+$ && "$2" =~ ^[0-9]+$ ]]; then
  echo "horovod_elastic.sh: usage: horovod_elastic.sh MIN_NP MAX_NP DISCOVERY_SCRIPT [flags...]" >&2
  exit 2
fi
min_np=$1 max_np=$2 discover=$3
shift 3
if [[ ! -x "$discover" ]]; then
  echo "horovod_elastic.sh: $discover is not an executable discovery script" >&2
  exit 2
fi

command=(horovodrun --gloo -np "$max_np" --min-np "$min_np" --max-np "$max_np"
         --host-discovery-script "$discover" tfbig-train --strategy=horovod --elastic "$@")
echo "+ ${command[*]}" >&2
[[ -n "${DRY_RUN:-}" ]] && exit 0
exec "${command[@]}"
