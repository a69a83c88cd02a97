#!/bin/sh
# Installs duplexbus into the image's virtualenv, in two steps so the heavy one is a layer
# of its own that survives source changes:
#   install.sh deps cpu|cuda   the dependencies (requirements.txt, read out of pyproject.toml, and
#                              constraints.txt alone are in /src)
#   install.sh app             the project itself, nothing more
# With wheels in /wheelhouse (built on the host: scripts/docker.sh wheelhouse, or brought
# in by hand on an air-gapped machine) nothing is downloaded; without, they come from PyPI.
set -eu
offline() { ls /wheelhouse/*.whl >/dev/null 2>&1; }
case "$1" in
  deps)
    if [ "$2" = cuda ] && ls /wheelhouse/cuda/*.whl >/dev/null 2>&1; then
      # Air-gapped: torch's CUDA build and its nvidia-* wheels brought into wheelhouse/cuda/
      # (`pip download torch==2.13.0 -d wheelhouse/cuda` on a machine that reaches PyPI).
      pip install --no-index --find-links /wheelhouse/cuda "torch==2.13.0"
    elif [ "$2" = cuda ]; then
      # PyPI's torch for Linux is the CUDA build; its CUDA libraries come as nvidia-* wheels.
      pip install "torch==2.13.0"
    elif ! offline; then
      # The CPU build: PyPI's default torch wheel pulls gigabytes of CUDA libraries.
      pip install "torch==2.13.0" --index-url "${TORCH_CPU_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
    fi
    # The versions `make` installs and the tests ran with (constraints.txt).
    # setuptools: what `install.sh app` builds the project with, offline too.
    if offline; then
      pip install --no-index --find-links /wheelhouse -c /src/constraints.txt setuptools -r /src/requirements.txt
    else
      pip install -c /src/constraints.txt setuptools -r /src/requirements.txt
    fi
    ;;
  app)
    pip install --no-deps --no-index --no-build-isolation /src
    ;;
  *)
    echo "usage: install.sh deps cpu|cuda | app" >&2
    exit 2
    ;;
esac
