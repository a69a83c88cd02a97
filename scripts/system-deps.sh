#!/usr/bin/env bash
# Debian packages the tests need, installed when missing: the browser test's Chromium, and
# under CI=true (or DUPLEXBUS_DOCKER=1) with no Docker engine reachable, the engine and the
# tools that build the stand-in base images (scripts/docker.sh).
set -euo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
if [ "${CI:-}" = true ] || [ "${DUPLEXBUS_DOCKER:-}" = 1 ]; then
  if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
    command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
    command -v busybox >/dev/null 2>&1 || need+=(busybox-static)
  fi
fi
if [ ${#need[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing ${need[*]} (apt-get)"
    apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "missing ${need[*]}: install them (the browser test is skipped without chromium, the compose test without Docker)" >&2
  fi
fi
