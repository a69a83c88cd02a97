"""Conductor: admission, placement, end-of-input and completion tracking."""
