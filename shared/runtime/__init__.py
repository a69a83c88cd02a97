"""The process runtime: config, errors, state guards, stats, process helpers."""
