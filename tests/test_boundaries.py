"""The control plane (scheduler, cache bookkeeping) never imports torch."""

import subprocess
import sys


def test_scheduler_and_cache_do_not_import_torch():
    code = (
        "import sys, ssmserve.scheduler, ssmserve.cache\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
