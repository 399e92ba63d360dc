# SGLang runtime image, part 2 of 2: SGLang, the patch series, the plugin and the SBOM, on the
# runtime base of part 1 (images/Dockerfile), collected into one layer.
#
# `nox -s build` builds the `layer` target: an image of that one layer (FROM scratch), which the
# build puts on top of the runtime base's layers itself. A rebuild after a patch change so reads,
# rewrites and loads megabytes, never the venv's gigabytes. A plain `docker build` of this file is
# not supported.
ARG RUNTIME_BASE

#### assemble: everything of part 2, installed where it runs ####
FROM ${RUNTIME_BASE} AS assemble
# Installing needs root; this stage is never run as a container, only its files are kept.
# hadolint ignore=DL3002
USER 0:0
ARG PYTHON_VERSION
COPY requirements/sglang.txt /tmp/requirements/
COPY wheelhouse/sglang/ /tmp/wheels/
# Checked-hash bytecode and a fixed hash seed, as in part 1.
RUN SOURCE_DATE_EPOCH=0 PYTHONHASHSEED=0 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
      /opt/venv/bin/pip install --no-index --find-links /tmp/wheels --require-hashes --no-deps \
      -r /tmp/requirements/sglang.txt
# The series and the applier (stdlib only) stay in the image: what was changed, and how, is
# there to read at /opt/sglang-image.
COPY image/ /opt/sglang-image/
# Same code as `nox -s patches`: zero fuzz; a failing hunk names the patch, the file and the line.
# Patched sources are recompiled (checked-hash) so that their bytecode is not stale.
RUN PYTHONPATH=/opt/sglang-image/tool PYTHONDONTWRITEBYTECODE=1 PYTHONHASHSEED=0 \
      /opt/venv/bin/python \
      -m sglang_image.patch apply --series-dir /opt/sglang-image/patches \
      --site-packages /opt/venv/lib/python${PYTHON_VERSION}/site-packages \
      --manifest /opt/sglang-image/patches.json \
 && PYTHONDONTWRITEBYTECODE=1 /opt/venv/bin/python /opt/sglang-image/tool/compile_patched.py \
      /opt/sglang-image/patches.json /opt/venv/lib/python${PYTHON_VERSION}/site-packages
# The project's SGLang plugin (flavors with `plugin = true`): built from plugin/ by the
# build, installed by hash like a locked wheel; SGLang loads it through its entry point.
RUN if [ -f /opt/sglang-image/plugin/requirements.txt ]; then \
      SOURCE_DATE_EPOCH=0 PYTHONHASHSEED=0 /opt/venv/bin/pip install --no-index --no-deps \
        --require-hashes --no-cache-dir --disable-pip-version-check \
        --find-links /opt/sglang-image/plugin -r /opt/sglang-image/plugin/requirements.txt; \
    fi
# CycloneDX SBOM of the installed environment, as installed (patches included); reproducible
# output: no random serial number, the commit's time as its timestamp (declared here, so that only
# this last, small step is rebuilt when the commit changes). Then the layer: the files of SGLang's
# and the plugin's distributions, the patched files and /opt/sglang-image, copied into /layer.
ARG SOURCE_DATE_EPOCH
RUN PYTHONDONTWRITEBYTECODE=1 /opt/venv/bin/cyclonedx-py environment --output-reproducible \
      --output-format JSON --output-file /opt/sglang-image/sbom.cdx.json /opt/venv/bin/python \
 && PYTHONDONTWRITEBYTECODE=1 /opt/venv/bin/python /opt/sglang-image/tool/collect_layer.py \
      --dest /layer --manifest /opt/sglang-image/patches.json --tree /opt/sglang-image \
      sglang sglang-image-plugin

#### layer: part 2 alone ####
FROM scratch AS layer
COPY --from=assemble /layer/ /
