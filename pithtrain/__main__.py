import signal
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from pithtrain.cli import main


def run() -> int:
    try:
        return main()
    except BaseException:
        # When one rank fails, torchrun SIGTERMs the others, some of which are failing too: a SIGTERM
        # while `record` writes this rank's error file would leave it empty, and torchrun's agent
        # fails reading it instead of reporting the job's failures.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise


# `record`: under torchrun a rank's uncaught exception and traceback reach the job's failure summary.
sys.exit(record(run)())
