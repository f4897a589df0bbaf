# jobspec runner image for NVIDIA GPUs: the default image (images/README.md has ROCm and CPU).
#
#   docker build -t ghcr.io/jobspec/runner:0.1.0-cuda .
#   docker run --rm --gpus all --shm-size=16g -v "$PWD/examples:/specs:ro" -v "$PWD/runs:/checkpoints" \
#       ghcr.io/jobspec/runner:0.1.0-cuda /specs/sft_fast.yaml
#
# The base brings CUDA, cuDNN, NCCL and a CUDA build of torch 2.13. CUDA 12.6 runs on drivers >= 560
# (and on older ones through forward compatibility); Blackwell GPUs need a CUDA 12.8+ base, e.g.
#   --build-arg BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime

# Build stage: the source tree becomes one wheel plus its list of runtime requirements. The runtime
# stage copies those two files, never the tree, the build backend or the pip index arguments.
FROM ${BASE_IMAGE} AS build
# Standard pip variables, for builds behind a mirror or offline (tests/container uses the last two).
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
WORKDIR /src
COPY . .
# `offload`: torchao for zero2_offload (GPU only; the CPU image leaves it out); `liger`: Liger Kernel for
# training.loss_kernel: liger (its triton is the one CUDA torch brings); `eval`: lm-evaluation-harness for
# eval.benchmarks at the end of a job
RUN sh images/jobspec-image.sh wheel /src /dist "runner offload liger data tracking s3 gcs eval"

FROM ${BASE_IMAGE}
ARG BASE_IMAGE
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_NO_INDEX
LABEL org.opencontainers.image.title="jobspec-runner-cuda" \
      org.opencontainers.image.description="jobspec in-container runner for NVIDIA GPUs: python -m runner SPEC" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/jobspec/jobspec" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      dev.jobspec.vendor="cuda"
# expandable_segments: fewer fragmentation OOMs when the micro-batch probe grows and shrinks batches.
# torch >= 2.9 reads PYTORCH_ALLOC_CONF, older torch only the vendor's name; the pod sets the same.
# PYTHONUNBUFFERED: log lines reach `kubectl logs` as they are written.
ENV PYTORCH_ALLOC_CONF=expandable_segments:True \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# Least-changing layers first: the user, then the dependencies (cached until pyproject.toml changes
# them), then the project wheel, rebuilt on every source change.
COPY images/jobspec-image.sh /tmp/jobspec/
RUN sh /tmp/jobspec/jobspec-image.sh user 1000 1000
COPY --from=build /dist/requirements.txt /tmp/jobspec/
RUN sh /tmp/jobspec/jobspec-image.sh deps /tmp/jobspec
COPY --from=build /dist/*.whl /tmp/jobspec/
RUN sh /tmp/jobspec/jobspec-image.sh project /tmp/jobspec && rm -rf /tmp/jobspec

# Numeric, so that a pod's runAsNonRoot can be checked against the image (contract.RUN_AS_UID/GID).
USER 1000:1000
# The rendered pod's workingDir: a relative checkpoints.dir resolves here.
WORKDIR /workspace
ENTRYPOINT ["python", "-m", "runner"]
CMD ["/etc/jobspec/spec.yaml"]
