"""Entry point for ``spark-submit``: the job ``pubcomp pipeline run`` runs, with the
master and resources that spark-submit was given."""

from __future__ import annotations

import argparse
import sys

from pubcomp.pipeline.job import run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="submit.py", description=__doc__)
    ap.add_argument("--landing", required=True)
    ap.add_argument("--warehouse", required=True)
    args = ap.parse_args(argv)
    print(run(args.landing, args.warehouse, master=None).line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
