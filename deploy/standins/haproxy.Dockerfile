# Stand-in for the public haproxy:2.6-alpine image, for machines that cannot pull it:
# Debian bookworm's haproxy (2.6), at the path and user the public image uses, and wget
# for the healthcheck (the alpine image has it from busybox).
FROM debian:bookworm-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends haproxy wget \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /usr/local/etc/haproxy /var/lib/haproxy \
 && ln -s /usr/sbin/haproxy /usr/local/sbin/haproxy \
 && chown haproxy:haproxy /var/lib/haproxy
USER haproxy
STOPSIGNAL SIGUSR1
ENTRYPOINT ["haproxy"]
CMD ["-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
