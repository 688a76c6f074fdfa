"""nodescope: the node agent for GPU training clusters."""

__version__ = "0.1.0"
