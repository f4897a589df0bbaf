"""Contracts shared by the submitter, the renderer and the in-container runner.

Everything here is a plain constant: the Job's podFailurePolicy, the runner's exit
paths and the CLI all read the same numbers, so they cannot drift apart.
"""

from __future__ import annotations

# Runner and CLI exit codes (docs/reference/errors.md is generated from these lines: a comment line after a code,
# indented `#   `, continues its meaning).
EXIT_OK = 0  # done
EXIT_FAILED = 1  # the job (or the training process) failed for a reason not listed below: a runner crash, an object
#   store or hub that did not answer (retried by the Job), `jobspec status` of a failed job
EXIT_CONFIG = 2  # bad spec, bad flag, bad input file; run directory in use by another run; no intact checkpoint;
#   a data object missing: retrying cannot help (podFailurePolicy FailJob)
EXIT_CLUSTER = 3  # CLI only: the Kubernetes API refused or could not be reached (RBAC refused, not found, conflict,
#   unreachable, timed out)
EXIT_NO_FIT = 4  # CLI only: `jobspec plan` found no tier that fits the GPU (not even micro-batch 1 at `minimal`)
EXIT_STORAGE = 74  # checkpoint volume full (ENOSPC, EDQUOT, or too little free space for the next checkpoint),
#   read-only or not writable; a data cache without room for an s3:// source: retrying cannot help (FailJob)
EXIT_OOM_RETRY_TIER = 75  # OOM at micro-batch 1: retry at the next memory tier (podFailurePolicy Count)
EXIT_OOM_LAST_TIER = 76  # OOM at the last tier: nothing left to try (podFailurePolicy FailJob)
EXIT_PREEMPTED = 143  # SIGTERM (or, in `jobspec run`, Ctrl-C, a closed terminal's SIGHUP, SIGQUIT): the steps
#   trained since the last checkpoint are checkpointed (none before the first step), then exit (128 + SIGTERM); a
#   second Ctrl-C stops at once

# Where the rendered pod finds things.
SPEC_MOUNT_DIR = "/etc/jobspec"
SPEC_FILE_NAME = "spec.yaml"
SPEC_PATH = f"{SPEC_MOUNT_DIR}/{SPEC_FILE_NAME}"
SHM_MOUNT = "/dev/shm"
SCRATCH_DIR = "/tmp"  # an emptyDir: with a read-only root, the only writable place besides checkpoints and shm
HF_CACHE_MOUNT = "/hf-cache"  # HF_HOME when the model or data come from the hub (model.hub_cache)
WORKDIR = "/workspace"  # the container's working directory: relative spec paths resolve here
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
# Live progress: rank 0 logs one line `<PROGRESS_PREFIX>{json}` per logged train step (runner/output/progress.py);
# `jobspec status`/`list`/`status -w` read the last one from a bounded tail of the pod's log (cluster/progress.py).
PROGRESS_PREFIX = "jobspec-progress/v1 "
PROGRESS_KEYS = ("step", "total_steps", "loss", "tokens_per_s", "eta_s", "tier", "micro_batch", "event")
# The events a progress line carries as the last OOM or tier change (metrics.jsonl's `event` names)
PROGRESS_EVENTS = ("oom_shrink", "oom_retry", "oom_regrow", "tier_change")

# Container user; the Dockerfiles create this uid/gid and the pod securityContext asks for it.
RUN_AS_UID = 1000
RUN_AS_GID = 1000

# Rendezvous port for torch.distributed across nodes (headless Service port).
RDZV_PORT = 29500

# Environment the rendered pod sets for the runner (multi-node rendezvous). Users cannot set JOBSPEC_*.
ENV_NODE_RANK = "JOBSPEC_NODE_RANK"
ENV_NNODES = "JOBSPEC_NNODES"
ENV_NPROC_PER_NODE = "JOBSPEC_NPROC_PER_NODE"
ENV_MASTER_ADDR = "JOBSPEC_MASTER_ADDR"
ENV_MASTER_PORT = "JOBSPEC_MASTER_PORT"
ENV_SPEC_HASH = "JOBSPEC_SPEC_HASH"  # lets the runner notice a spec ConfigMap replaced under a running Job
RESERVED_ENV_PREFIX = "JOBSPEC_"

# Labels and annotations put on every rendered object.
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "jobspec"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_JOB = "jobspec.dev/job"
ANNOTATION_SPEC_HASH = "jobspec.dev/spec-hash"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"

# Files the runner keeps beside its checkpoints.
TIER_STATE_FILE = "tier_state.json"
METRICS_FILE = "metrics.jsonl"
