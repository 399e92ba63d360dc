#!/bin/sh
# The runtime base's venv: every locked wheel but SGLang's, from the wheelhouse the build mounts
# read-only at /tmp/build-inputs (deps.txt and wheels/). The build runs this as root in a container
# of images/Dockerfile's image, network off, in a clean environment (PYTHON_VERSION, PATH, HOME),
# and makes what the container changed the image's last layer (dockerbuild.install_venv).
set -eu
inputs=/tmp/build-inputs
# pip comes from the base interpreter's ensurepip (pinned by the base digest): no download, and
# --no-deps: the lock is complete, so nothing is resolved here. Any SOURCE_DATE_EPOCH makes
# py_compile write checked-hash bytecode (no timestamps); a fixed hash seed keeps set constants in
# a stable order. Set for this step only: the image itself keeps hash randomisation.
export SOURCE_DATE_EPOCH=0 PYTHONHASHSEED=0 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
"python${PYTHON_VERSION}" -m venv /opt/venv
/opt/venv/bin/pip install --no-index --find-links "$inputs/wheels" --require-hashes --no-deps \
  -r "$inputs/deps.txt"
