"""Benchmark and GPU-host driver of a patched sglang runtime: `python -m bench {run,e2e,comm}`.

Runs on a GPU host whose Python has the image's sglang (or the wheel bundle of `nox -s gpu-e2e`),
never inside the image: it drives the servers of the in-image smoke package (`smoke`), which it
imports, and nothing in `smoke` imports it. Standard library only at import time, and the
plugin's contract for the speculation setting (sglang_image_plugin.setting, standard library only
too): run it from the repository's root with `PYTHONPATH=plugin` (`nox -s bench` sets it).
"""
