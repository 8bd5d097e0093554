"""Run a script on checkpointless.accelerate and SIGKILL one rank during an evaluation.

    EVAL_KILL=RANK:CALL[:SIGNAL] EVAL_KILL_MARKER=/tmp/x python -m checkpointless ... \
        tests/support/scripts/accelerate_eval_kill.py examples/accelerate_checkpointless.py --cpu

Without EVAL_KILL it kills nothing. With SKIP_END_TRAINING=1 the script's own call to
`accelerator.end_training()` does nothing, as if the script never made it (many accelerate scripts
do not): the run must still end cleanly.

The worker holding RANK gets SIGNAL (KILL by default; STOP makes it hang) as it enters its
CALL-th `gather_for_metrics` (counted over the run), while its peers wait in that gather. The kill fires once per run: the first worker to reach it
creates the marker file, so the spare that takes over the rank does not die again. (The library's
own faults strike at the start of a training step; this one strikes between steps.)
"""
import os
import runpy
import signal
import sys

from checkpointless.accelerate import Accelerator

RANK, CALL, *SIGNAL = os.environ.get("EVAL_KILL", "-1:0").split(":")
RANK, CALL, SIGNAL = int(RANK), int(CALL), getattr(signal, f"SIG{(SIGNAL or ['KILL'])[0]}")
MARKER = os.environ.get("EVAL_KILL_MARKER", "")
_original = Accelerator.gather_for_metrics
_calls = 0


def gather_for_metrics(self, *args, **kwargs):
    global _calls
    if self.process_index == RANK:
        _calls += 1
        if _calls == CALL:
            try:
                os.close(os.open(MARKER, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                print(f"[eval-kill] {SIGNAL.name} to rank {RANK} in gather_for_metrics call "
                      f"{CALL}", flush=True)
                os.kill(os.getpid(), SIGNAL)
    return _original(self, *args, **kwargs)


Accelerator.gather_for_metrics = gather_for_metrics
if os.environ.get("SKIP_END_TRAINING") == "1":
    # the library's exit hook calls its own _end_training(), not this
    Accelerator.end_training = lambda self, result=None: None
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
