"""The processes of a pod, from the entry point down. Read in this order:

    supervisor.py  `python -m runner SPEC`: checks, starts one worker per GPU, relaunches at the next tier
    preflight.py   what the supervisor checks before any heavy import (a mistake costs a second)
    worker.py      one rank: process group, `Recipe`, exit codes the Job's podFailurePolicy matches
    lifeline.py    a worker dies with its supervisor, by any signal (the kernel's parent-death signal)
    heartbeat.py   the gang's heartbeat: a rank silent past the spec's timeout is lost, the others exit to restart
"""
