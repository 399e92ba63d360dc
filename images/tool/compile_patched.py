"""Recompiles the files that the patch series changed (checked-hash bytecode: no timestamps).

Usage: compile_patched.py PATCHES_JSON SITE_PACKAGES  (stdlib only; runs inside the image)
"""
import json
import py_compile
import sys
from pathlib import Path

manifest, site_packages = Path(sys.argv[1]), Path(sys.argv[2])
for entry in json.loads(manifest.read_text()):
    for name in entry["files"]:
        path = site_packages / name
        if path.suffix == ".py" and path.is_file():
            py_compile.compile(str(path), doraise=True,
                               invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
