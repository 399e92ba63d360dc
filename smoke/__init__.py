"""Smoke test of a patched sglang runtime: `python -m smoke {models,run,partial,features}`.

Standard library only at import time (torch/transformers are imported by `models` when it runs), and
the plugin's contract for the speculation setting (sglang_image_plugin.setting, standard library
only too: plugin/ on PYTHONPATH, the image smoke's mount of it, or the project's install), so the
package runs inside the image, on the GPU machine and in the CPU tests alike. The benchmark
and the GPU host's driver are bench/, which imports this package (never the other way).
"""
