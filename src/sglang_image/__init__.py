"""Build system for a reproducible, patched SGLang runtime image (SM120 / CUDA 13).

Every command is a stage module with run(flavor, options) (cli.py dispatches): build (plan,
context, dockerbuild), base, docker_engine, image_smoke, publish, deploy (topology), gpu,
plugin_check, patch_series and lock; pins, fetch, patch and the rest serve them.
"""
