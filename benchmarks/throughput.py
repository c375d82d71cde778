"""Same as `ssmserve bench throughput`: `python benchmarks/throughput.py --help` lists the flags.

README.md (Command line) shows the commands; benchmarks/configs/ holds real-size configs for
runs with random weights (--load-format dummy).
"""

from __future__ import annotations

import sys

from ssmserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))
