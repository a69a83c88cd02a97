"""The bus: wire schema, subject names, the NATS connection, the embedded server.

The only package that imports nats-py."""
