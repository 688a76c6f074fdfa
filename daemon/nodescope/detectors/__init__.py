"""Detectors: pure functions from snapshots to findings (see ``registry``)."""
