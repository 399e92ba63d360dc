"""Smoke test and benchmark of a patched sglang runtime: `python -m smoke {models,run,bench,e2e}`.

Standard library only at import time (torch/transformers are imported by `models` when it runs), so
the package runs inside the image, on the GPU machine and in the CPU tests alike.
"""
