"""What a hostile user of a shared node, or a real kernel file, does to the daemon.

Each test here reproduces one way an unprivileged user, an odd file or a real pseudo-file
could blind, freeze or mislead nodescope, and checks that it no longer does.
"""
