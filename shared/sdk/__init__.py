"""The model SDK: what a model author reads (model API, topology, chunk policies, audio)."""
