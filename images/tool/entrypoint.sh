#!/bin/sh
# Starts the SGLang server with the given arguments. --host/--port come first so that the
# HEALTHCHECK finds it; arguments given after them win (argparse keeps the last).
set -eu
exec /opt/venv/bin/python -m sglang.launch_server \
  --host "${SGLANG_HOST:-0.0.0.0}" --port "${SGLANG_PORT:-30000}" "$@"
