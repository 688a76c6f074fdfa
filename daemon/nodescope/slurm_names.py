"""Slurm's names as slurm.conf and scontrol write them: a node's name and a job's id.

The hooks read them from a job's environment and requests, the remediation from scontrol's
output and findings; neither owns them, so neither has to load the other to check one.
"""

from __future__ import annotations

import re

#: A node name as slurm.conf allows it (no spaces, no commas, no brackets).
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: A job id as ``scontrol requeue`` takes it (array and het jobs included).
JOB_ID = re.compile(r"[0-9]{1,12}(?:_[0-9]{1,12}|\+[0-9]{1,4})?")
