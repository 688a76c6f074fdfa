"""Bandwidth probes: PCIe copy bandwidth per GPU, the GPU pair matrix, a local all-reduce.

Run as its own process (``python -m nodescope.probe``, what ``nodescope probe`` starts): the
measuring modules (:mod:`.measure`, :mod:`.allreduce`) import torch, which the daemon never
does. The other modules here are pure and torch-free: the size sweep and bandwidth formulas
(:mod:`.sweep`), thresholds to verdict (:mod:`.verdict`) and the table (:mod:`.table`); the
progress bar is the commands' (:mod:`nodescope.progress`). The report format is
:mod:`nodescope.model.probe`.
"""
