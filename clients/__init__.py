"""Client tools: call, replay, load."""
