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
COPY duplexbus /src/duplexbus
COPY shared /src/shared
COPY services /src/services
COPY models /src/models
COPY clients /src/clients

FROM base AS build-base
RUN python -m venv "$VIRTUAL_ENV"
COPY deploy/install.sh /usr/local/bin/duplexbus-install
COPY wheelhouse/ /wheelhouse/
# pyproject.toml and constraints.txt alone first: the dependency layer is rebuilt only when
# they change. The versions are constraints.txt's, as in `make`.
COPY pyproject.toml constraints.txt /src/

FROM build-base AS build-cpu
RUN duplexbus-install deps cpu
COPY --from=source /src/ /src/
RUN duplexbus-install app

FROM build-base AS build-cuda
RUN duplexbus-install deps cuda
COPY --from=source /src/ /src/
RUN duplexbus-install app

FROM base AS runtime
# A non-root user; the services write nothing but the heartbeat file `duplexbus health` reads.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin duplexbus
ENV DUPLEXBUS_HEALTH_FILE=/tmp/duplexbus.alive
WORKDIR /home/duplexbus
EXPOSE 8000

FROM runtime AS cuda
# The NVIDIA container runtime mounts the host's driver; torch's wheels bring the CUDA libraries.
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=build-cuda /opt/duplexbus /opt/duplexbus
USER duplexbus
CMD ["duplexbus", "worker"]

FROM runtime AS cpu
COPY --from=build-cpu /opt/duplexbus /opt/duplexbus
USER duplexbus
CMD ["duplexbus", "frontend", "--host", "0.0.0.0", "--port", "8000"]
