"""Build system for a reproducible, patched SGLang runtime image (SM120 / CUDA 13).

One module per stage: pins -> lock -> fetch -> patch -> build -> smoke -> publish.
"""
