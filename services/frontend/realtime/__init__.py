"""`WS /v1/realtime`: the OpenAI Realtime API on top of calls (docs/realtime.md)."""
