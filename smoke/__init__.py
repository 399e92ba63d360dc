"""Smoke test of a patched sglang runtime: `python -m smoke {models,run,partial,features}`.

Standard library only at import time (torch/transformers are imported by `models` when it runs), so
the package runs inside the image, on the GPU machine and in the CPU tests alike. The benchmark
and the GPU host's driver are bench/, which imports this package (never the other way).
"""
