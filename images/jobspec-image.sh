#!/bin/sh
# The steps the three Dockerfiles share (Dockerfile, images/Dockerfile.rocm, images/Dockerfile.cpu).
# Runs as root at build time, with `python` the interpreter the image will run (the base's, or the
# CPU image's venv):
#
#   jobspec-image.sh wheel SRC DIST [EXTRAS]   build stage: SRC -> DIST/jobspec_k8s-*.whl + DIST/requirements.txt
#                                     (EXTRAS: the extras the image carries, default "runner data tracking s3 gcs eval")
#   jobspec-image.sh user UID GID     runtime: the non-root user the pod runs as (contract.RUN_AS_UID/GID)
#   jobspec-image.sh deps DIST        runtime: install DIST/requirements.txt, keeping the base's torch
#   jobspec-image.sh project DIST     runtime: install the wheel itself (no deps) and import it
#
# Why torch is pinned: the CUDA and ROCm bases ship a torch built for their toolkit. Left alone,
# pip may "upgrade" it to PyPI's build (gigabytes, and a different CUDA or no ROCm at all).
# `deps` writes a constraint `torch==<the installed version>` so pip either keeps that torch or
# fails the build; it then checks the version did not change.
set -eu

die() {
    echo "jobspec-image.sh: $*" >&2
    exit 1
}

torch_version() {
    python -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null
}

pip_install() {
    python -m pip install --no-cache-dir --disable-pip-version-check --root-user-action=ignore "$@"
}

cmd_wheel() {
    src=$1 dist=$2 extras=${3:-runner data tracking s3 gcs eval}
    mkdir -p "$dist"
    python -m pip wheel --no-cache-dir --disable-pip-version-check --no-deps --wheel-dir "$dist" "$src"
    # Runtime requirements (base + the image's extras), straight from pyproject.toml: the runtime stage
    # installs them in their own layer, cached while they do not change.
    python - "$src/pyproject.toml" $extras >"$dist/requirements.txt" <<'EOF'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
extras = project["optional-dependencies"]
print("\n".join(project["dependencies"] + [req for name in sys.argv[2:] for req in extras[name]]))
EOF
    echo "requirements for the runtime image:" && cat "$dist/requirements.txt"
}

cmd_user() {
    uid=$1 gid=$2 name=jobspec
    # Ubuntu 24.04+ bases (rocm/pytorch) already hold uid/gid 1000 as "ubuntu": give the ids to
    # our user so that the rendered securityContext (runAsUser 1000) maps to a named user.
    old_user=$(getent passwd "$uid" | cut -d: -f1) || true
    if [ -n "$old_user" ] && [ "$old_user" != "$name" ]; then
        userdel --remove "$old_user" 2>/dev/null || userdel "$old_user"
    fi
    old_group=$(getent group "$gid" | cut -d: -f1) || true
    if [ -n "$old_group" ] && [ "$old_group" != "$name" ]; then
        groupdel "$old_group"
    fi
    getent group "$name" >/dev/null || groupadd --gid "$gid" "$name"
    getent passwd "$name" >/dev/null ||
        useradd --uid "$uid" --gid "$gid" --create-home --home-dir "/home/$name" --shell /bin/sh "$name"
    # The working directory (the pod's workingDir) and the spec's default checkpoints.dir: writable
    # without a volume, so that a bare `docker run` works.
    install -d -o "$uid" -g "$gid" -m 0775 /workspace /checkpoints
}

cmd_deps() {
    dist=$1
    before=$(torch_version) ||
        die "the base image has no torch: use a PyTorch base image (BASE_IMAGE), or images/Dockerfile.cpu"
    echo "torch==$before" >"$dist/constraints.txt"
    echo "keeping the base image's torch $before"
    pip_install --constraint "$dist/constraints.txt" --requirement "$dist/requirements.txt"
    after=$(torch_version)
    [ "$before" = "$after" ] || die "pip replaced the base image's torch $before with $after"
}

cmd_project() {
    dist=$1
    set -- "$dist"/jobspec_k8s-*.whl # the distribution jobspec-k8s (the import package is jobspec)
    if [ "$#" -ne 1 ] || [ ! -f "$1" ]; then
        die "expected one jobspec-k8s wheel in $dist, found: $*"
    fi
    pip_install --no-deps "$1"
    python -c 'import jobspec, runner, torch, transformers, accelerate; print("jobspec", jobspec.__version__, "torch", torch.__version__)'
}

[ "$#" -ge 1 ] || die "usage: jobspec-image.sh wheel|user|deps|project ARGS"
step=$1
shift
case "$step" in
wheel) cmd_wheel "$@" ;;
user) cmd_user "$@" ;;
deps) cmd_deps "$@" ;;
project) cmd_project "$@" ;;
*) die "unknown step: $step" ;;
esac
