"""Same as `ssmserve bench serving`: `python benchmarks/serving.py --help` lists the flags.

README.md (Command line) shows the commands; benchmarks/configs/ holds real-size configs for
runs with random weights (--load-format dummy).
"""

from __future__ import annotations

import sys

from ssmserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serving", *sys.argv[1:]]))
