"""`python -m benchmarks NAME [flags]`: an experiment, with `meshnode bench`'s flags."""
import argparse
import sys

from benchmarks import EXPERIMENTS
from meshnode.bench import add_args, run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    add_args(p, EXPERIMENTS)
    return run(p.parse_args(argv), package="benchmarks")


if __name__ == "__main__":
    sys.exit(main())
