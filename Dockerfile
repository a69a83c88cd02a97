# One image for every duplexbus service; the command picks the role (docker-compose.yml).
#   docker build -t duplexbus .                         CPU (the default target)
#   docker build --target cuda -t duplexbus:cuda .      torch's CUDA build, for the gpu profile
# Wheels in wheelhouse/ are installed offline (--no-index): `scripts/docker.sh wheelhouse`
# builds them on the host, as an air-gapped machine needs. Without them pip uses PyPI.
FROM python:3.11-slim AS base
ENV VIRTUAL_ENV=/opt/duplexbus \
    PATH=/opt/duplexbus/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# The project's source, once for both builds below.
FROM scratch AS source
COPY pyproject.toml /src/
COPY duplexbus /src/duplexbus
COPY shared /src/shared
COPY services /src/services
COPY models /src/models
COPY clients /src/clients

# The dependencies the image needs, read out of pyproject.toml: its own and its models extra.
# Only this file reaches the dependency layer below, and a copy is cached by its content, so
# an edit to anything else in pyproject.toml (a tool's settings, the dev extra) does not
# install every wheel again.
FROM base AS requirements
COPY pyproject.toml /src/
RUN python -c 'import tomllib; p = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + p["optional-dependencies"]["models"]))' >/requirements.txt

FROM base AS build-base
RUN python -m venv "$VIRTUAL_ENV"
COPY deploy/install.sh /usr/local/bin/duplexbus-install
COPY wheelhouse/ /wheelhouse/
# The requirements and constraints.txt alone first: the dependency layer is rebuilt only when
# they change. The versions are constraints.txt's, as in `make`.
COPY --from=requirements /requirements.txt /src/
COPY constraints.txt /src/

FROM build-base AS deps-cpu
RUN duplexbus-install deps cpu

FROM build-base AS deps-cuda
RUN duplexbus-install deps cuda

FROM base AS runtime
# A non-root user; the services write nothing but the heartbeat file `duplexbus health` reads.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin duplexbus
ENV DUPLEXBUS_HEALTH_FILE=/tmp/duplexbus.alive
WORKDIR /home/duplexbus
EXPOSE 8000
COPY deploy/install.sh /usr/local/bin/duplexbus-install

# In each final image the dependencies are one layer (over a gigabyte, kept while they do not
# change) and the project a small one above it: a change to the source builds and ships only
# that one, in seconds, instead of copying the whole virtualenv again.
FROM runtime AS cuda
# The NVIDIA container runtime mounts the host's driver; torch's wheels bring the CUDA libraries.
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=deps-cuda /opt/duplexbus /opt/duplexbus
COPY --from=source /src/ /src/
RUN duplexbus-install app && rm -rf /src
USER duplexbus
CMD ["duplexbus", "worker"]

FROM runtime AS cpu
COPY --from=deps-cpu /opt/duplexbus /opt/duplexbus
COPY --from=source /src/ /src/
RUN duplexbus-install app && rm -rf /src
USER duplexbus
CMD ["duplexbus", "frontend", "--host", "0.0.0.0", "--port", "8000"]
