"""python -m smoke {models,run,partial,features} ... (see each module's docstring)."""
from __future__ import annotations

import argparse
import sys

from smoke import features, models, partial, run_command


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m smoke", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, mod, help_ in (("models", models, "generate the tiny/1B-shaped models offline"),
                             ("run", run_command, "smoke checks against servers started here"),
                             ("partial", partial, "image checks that need no GPU (PARTIAL)"),
                             ("features", features, "what users send, across the mode changes")):
        p = sub.add_parser(name, help=help_, description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(main=mod.main)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return int(a.main(a))


if __name__ == "__main__":
    sys.exit(main())
