"""The ``nodescope`` command line."""
