"""Typed, immutable records. This floor imports nothing else of nodescope."""
