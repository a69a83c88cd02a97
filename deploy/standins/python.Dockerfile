# Stand-in for the public python:3.11-slim image, for machines that cannot pull it, built
# on a Debian bookworm root filesystem made with debootstrap (bookworm's python3 is 3.11).
# It carries what the project's Dockerfile expects of the real image: `python` and `pip`
# on PATH, the venv module, pip free to install (no EXTERNALLY-MANAGED marker), root.
FROM debian:bookworm-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv python3-pip ca-certificates \
 && rm -rf /var/lib/apt/lists/* /usr/lib/python3.11/EXTERNALLY-MANAGED \
 && ln -s /usr/bin/python3 /usr/local/bin/python \
 && ln -s /usr/bin/python3 /usr/local/bin/python3 \
 && ln -s /usr/bin/pip3 /usr/local/bin/pip
ENV LANG=C.UTF-8
CMD ["python3"]
