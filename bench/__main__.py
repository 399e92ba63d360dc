"""python -m bench {run,e2e,comm,merge,schedule,auto-trace,pyspy-diff,verify-kernel} ... (see each module's docstring)."""
from __future__ import annotations

import argparse
import sys

from bench import (
    autotrace,
    comm,
    depth_choice,
    e2e,
    merge,
    options,
    pyspy,
    throughput,
    verify_kernel,
)


def _add_comm_arguments(ap: argparse.ArgumentParser) -> None:
    """`comm` is the e2e driver with the phases that prove the 2-GPU all-reduce (bench/comm.py)."""
    e2e.add_arguments(ap)  # --comm-runs is there too
    ap.set_defaults(phases="install,patch,models,comm")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, doc, add_arguments, run, help_ in (
            ("run", throughput.__doc__, options.add_arguments, throughput.main,
             "throughput: plain / EAGLE-3 / EAGLE-3 + threshold, side by side"),
            ("e2e", e2e.__doc__, e2e.add_arguments, e2e.main,
             "the whole GPU-host run: install, patch, models, smoke, bench"),
            ("comm", comm.__doc__, _add_comm_arguments, e2e.main,
             "2-GPU all-reduce proof: e2e's install,patch,models,comm"),
            ("merge", merge.__doc__, merge.add_arguments, merge.main,
             "several calls' bench.json as one report (the concurrencies one card could not hold at once)"),
            ("schedule", depth_choice.__doc__, depth_choice.add_arguments, depth_choice.main,
             "the draft depth per load a bench of fixed depths measured best, as a depth schedule"),
            ("auto-trace", autotrace.__doc__, autotrace.add_arguments, autotrace.main,
             "an auto server's step trace, per batch-size bucket and mode"),
            ("pyspy-diff", pyspy.main.__doc__, pyspy.add_arguments, pyspy.main,
             "two servers' scheduler samples (--diagnose) set against each other, function by function"),
            ("verify-kernel", verify_kernel.__doc__, verify_kernel.add_arguments, verify_kernel.main,
             "the EAGLE verify's attention alone: upstream's prefill kernel against its split-KV one")):
        p = sub.add_parser(name, help=help_, description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(p)
        p.set_defaults(main=run)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return int(a.main(a))


if __name__ == "__main__":
    sys.exit(main())
