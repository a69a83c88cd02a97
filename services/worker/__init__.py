"""Worker: stream buffers, chunk policies, batched steps across calls."""
