"""python -m launcher.bench.scale: the harness's command line (harness.py)."""
import os
import sys

from launcher.bench.scale.harness import main

code = main()
sys.stdout.flush()
# the simulated ranks' threads are blocked in the store of a coordinator that is gone; an
# ordinary exit would let c10d raise into them as the interpreter shuts down
os._exit(code)
