"""Code shared by every service: wire schema, subjects, model API, config, errors."""
