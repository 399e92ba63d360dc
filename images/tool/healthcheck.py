"""HEALTHCHECK: exit 0 when the server answers GET /health with 200 (stdlib only: no curl here)."""
import os
import sys
import urllib.request

port = os.environ.get("SGLANG_IMAGE_HTTP_PORT", "30000")  # the entrypoint's --port
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=25) as response:
        sys.exit(0 if response.status == 200 else 1)
except OSError as exc:
    print(f"unhealthy: {exc}", file=sys.stderr)
    sys.exit(1)
