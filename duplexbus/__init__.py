"""duplexbus: full-duplex streaming model serving on NATS JetStream."""

__version__ = "0.1.0"
