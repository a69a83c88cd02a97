"""Frontend: sockets, protocol parsing, per-call input state, relaying outputs."""
