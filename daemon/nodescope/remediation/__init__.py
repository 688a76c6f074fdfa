"""Acting on findings: the policy that decides (:mod:`~nodescope.remediation.policy`, pure),
Slurm read and changed through ``scontrol`` (:mod:`~nodescope.remediation.slurm`), and the
record of what nodescope did (:mod:`~nodescope.remediation.state`)."""
