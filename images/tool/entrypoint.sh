#!/bin/sh
# Starts the SGLang server with the given arguments. --host/--port come first so that the
# HEALTHCHECK finds it; arguments given after them win (argparse keeps the last).
set -eu
# SGLANG_PLUGINS is SGLang's allowlist of plugins. Dynamic speculation disable is our plugin
# (sglang_image): an allowlist without it would ignore SGLANG_SPEC_DISABLE_BATCH_THRESHOLD
# silently, so refuse to start instead.
plugins=$(printf '%s' "${SGLANG_PLUGINS:-}" | tr -d ' \t')
if [ -n "$plugins" ]; then
  case ",$plugins," in
    *,sglang_image,*) ;;
    *)
      wants=${SGLANG_SPEC_DISABLE_BATCH_THRESHOLD:-}
      for arg in "$@"; do
        case "$arg" in --speculative-disable-*) wants=$arg ;; esac
      done
      if [ -n "$wants" ]; then
        echo "error: SGLANG_PLUGINS=$SGLANG_PLUGINS leaves out sglang_image, the plugin behind" \
          "dynamic speculation disable ($wants would be ignored or refused): add sglang_image" \
          "to SGLANG_PLUGINS, or unset SGLANG_PLUGINS to load every installed plugin" >&2
        exit 2
      fi
      ;;
  esac
fi
# The HTTP address is the image's own variable: SGLANG_PORT is SGLang's first port for its internal
# sockets (images/Dockerfile says why it stays unset).
port=${SGLANG_IMAGE_HTTP_PORT:-30000}
case "$port" in
  ''|*[!0-9]*)
    echo "error: SGLANG_IMAGE_HTTP_PORT=$port is not a port number. Kubernetes sets" \
      "NAME_PORT=tcp://IP:PORT in a pod for every Service of its namespace: give a number, and" \
      "set enableServiceLinks: false in the pod spec (or rename the Service)" >&2
    exit 2
    ;;
esac
# A model folder that is not there (a typo, a volume not mounted) or that this user cannot read
# would end in a transformers traceback about repo ids: name the path and the fix instead. Only
# absolute paths: anything else may be a hub repo id, which SGLang resolves itself.
check_model() {  # FLAG PATH
  case "$2" in /*) ;; *) return 0 ;; esac
  if [ ! -e "$2" ]; then
    echo "error: $1 $2: no such folder in the container: mount the models volume (read-only," \
      "readable by uid 1000) so that it holds $2, or give the path of the model inside it" >&2
    exit 2
  fi
  if [ ! -r "$2" ] || { [ -d "$2" ] && [ ! -x "$2" ]; } \
      || { [ -e "$2/config.json" ] && [ ! -r "$2/config.json" ]; }; then
    echo "error: $1 $2 is not readable by uid $(id -u): make the models volume readable by" \
      "uid 1000, the image's user (on the host: chmod -R a+rX; on Kubernetes: fsGroup 1000)" >&2
    exit 2
  fi
}
flag=
for arg in "$@"; do
  case "$flag" in
    --model-path|--model|--speculative-draft-model-path|--speculative-draft-model)
      check_model "$flag" "$arg" ;;
  esac
  case "$arg" in
    --model-path=*|--model=*|--speculative-draft-model-path=*|--speculative-draft-model=*)
      check_model "${arg%%=*}" "${arg#*=}" ;;
  esac
  flag=$arg
done
# An API key from the environment (Compose's env file) rather than the command line, which
# `docker inspect` shows: given before the arguments, so that an --api-key among them wins.
if [ -n "${SGLANG_IMAGE_API_KEY:-}" ]; then
  set -- --api-key "$SGLANG_IMAGE_API_KEY" "$@"
fi
exec "${SGLANG_PYTHON:-/opt/venv/bin/python}" -m sglang.launch_server \
  --host "${SGLANG_IMAGE_HTTP_HOST:-0.0.0.0}" --port "$port" "$@"
