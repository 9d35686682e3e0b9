#!/usr/bin/env bash
# Build tfbig's CPU image where no image registry is reachable, then run it.
#
#   docker/build_cpu_image.sh base      # Debian bookworm root file system (debootstrap) -> local image
#   docker/build_cpu_image.sh build     # docker/Dockerfile.cpu FROM that base -> tfbig:cpu
#   docker/build_cpu_image.sh main      # the main job inside the image (prints its wall time)
#   docker/build_cpu_image.sh horovod   # a 2-process horovodrun --gloo inside the image
#   docker/build_cpu_image.sh all       # the four in turn
#
# With a registry, `docker build -f docker/Dockerfile.cpu -t tfbig:cpu .` needs none of this:
# the Dockerfile's BASE defaults to the public python:3.11-slim-bookworm.
#
# ENGINE (default podman; docker works too), MIRROR (Debian mirror), ROOTFS (where debootstrap
# writes; needs root), ENGINE_OPTS (global engine options) and RUN_OPTS (for build and run).
# The defaults for podman are what this class of machine needs: crun cannot set
# RLIMIT_NOFILE here ("setrlimit RLIMIT_NOFILE: Operation not permitted"), runc can, with
# limits no higher than the host's.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=${ENGINE:-podman}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
ROOTFS=${ROOTFS:-/tmp/tfbig-rootfs-bookworm}
BASE_IMAGE=${BASE_IMAGE:-localhost/tfbig-base:bookworm}
IMAGE=${IMAGE:-localhost/tfbig:cpu}
if [ "$ENGINE" = podman ]; then
  read -r -a ENGINE_OPTS <<< "${ENGINE_OPTS:---runtime runc}"
  read -r -a RUN_OPTS <<< "${RUN_OPTS:---ulimit nofile=1024:1024 --ulimit nproc=1024:1024}"
else
  read -r -a ENGINE_OPTS <<< "${ENGINE_OPTS:-}"
  read -r -a RUN_OPTS <<< "${RUN_OPTS:-}"
fi
engine() { "$ENGINE" "${ENGINE_OPTS[@]}" "$@"; }

base() {
  command -v debootstrap >/dev/null || { echo "build_cpu_image.sh: debootstrap is needed (apt-get install debootstrap)" >&2; exit 1; }
  if [ ! -x "$ROOTFS/usr/bin/python3" ]; then
    debootstrap --variant=minbase \
      --include=python3,python3-venv,python3-dev,ca-certificates bookworm "$ROOTFS" "$MIRROR"
    # the image's apt reads the same mirror; nothing cached is kept in the layer
    rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
  fi
  # The base trusts what this host trusts: behind a TLS-inspecting proxy (as here) pip in the
  # build fails with CERTIFICATE_VERIFY_FAILED without the host's local CAs.
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
    chroot "$ROOTFS" update-ca-certificates >/dev/null
  fi
  tar -C "$ROOTFS" -c . | engine import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE"
}

build() {
  engine build "${RUN_OPTS[@]}" --build-arg "BASE=$BASE_IMAGE" -f docker/Dockerfile.cpu \
    -t "$IMAGE" .
  engine image inspect --format 'image {{.Id}} size {{.Size}} bytes' "$IMAGE"
}

main_job() {
  local start=$SECONDS
  engine run --rm "${RUN_OPTS[@]}" "$IMAGE"
  echo "build_cpu_image.sh: main job in the container: $((SECONDS - start)) s wall"
}

horovod() {
  engine run --rm "${RUN_OPTS[@]}" "$IMAGE" bash -c '
    tfbig-prep --output_dir=/tmp/data --seq_length=64 --vocab_size=512 &&
    horovodrun -np 2 -H localhost:2 --gloo tfbig-train --strategy=horovod --preset=tiny \
      --data_dir=/tmp/data --model_dir=/tmp/run --seq_length=64 --batch_size=8 \
      --max_steps=20 --log_every=10 --sample_tokens=0'
}

case "${1:-all}" in
  base) base ;;
  build) build ;;
  main) main_job ;;
  horovod) horovod ;;
  all) base; build; main_job; horovod ;;
  *) echo "usage: $0 [base|build|main|horovod|all]" >&2; exit 2 ;;
esac
