"""A worker for tests/library/control/test_forkserver.py: `python -m tests.support.scripts.fork_target OUT CODE [sleep]`
writes what it sees to OUT (JSON) and exits with CODE."""
import json
import os
import random
import sys
import time


def preload(args) -> None:
    # kept where the child's fresh run of this module as __main__ can see it
    sys.fork_target_preloaded_by = os.getpid()
    time.sleep(float(os.environ.get("PRELOAD_S", "0")))  # a slow preload


if __name__ == "__main__":
    out, code = sys.argv[1], int(sys.argv[2])
    with open(out, "w") as f:
        json.dump({"pid": os.getpid(), "pgid": os.getpgid(0), "argv": sys.argv,
                   "preloaded_by": getattr(sys, "fork_target_preloaded_by", None),
                   "wid": os.environ.get("CL_WORKER_ID"), "base": os.environ.get("BASE_VAR"),
                   "stdin": os.readlink("/proc/self/fd/0"), "random": random.random()}, f)
    if len(sys.argv) > 3:
        time.sleep(float(sys.argv[3]))
    sys.exit(code)
