"""Runner images a user builds, pushes and pins: `jobspec image build | push | show`.

The project's Dockerfiles (root `Dockerfile` for CUDA, `images/Dockerfile.rocm`, `images/Dockerfile.cpu`) are
built with the docker or podman found on PATH; each image is tagged by version (`<repo>:<version>-<vendor>`) and by
content (`...-<vendor>-<12 hex>`, a hash of the build context, the Dockerfile and the build arguments), pushed to
the user's registry, and its digest recorded. `render` then pins a spec without `image.name` to the recorded image
of its vendor (`repo:tag@sha256:...`); with nothing recorded it renders the default tag and `validate`, `render`
and `submit` say how to build one.

Read in this order:
    context.py  the source checkout, the Dockerfile of each vendor, the build context's content hash and the tags
    record.py   the record of pushed images (~/.config/jobspec/images.json, or $JOBSPEC_IMAGES): read, written
    engine.py   docker or podman: build, push, the pushed digest
    cli.py      the `jobspec image` subcommands
"""
