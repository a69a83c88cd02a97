"""duplexbus: full-duplex streaming model serving on NATS JetStream."""

from shared.runtime.version import VERSION as __version__

__all__ = ["__version__"]
