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


def entry() -> int:
    """`python -m pithtrain` and the installed `pithtrain` command alike: under torchrun, `record`
    brings a rank's uncaught exception and traceback to the job's failure summary."""
    return record(run)()


if __name__ == "__main__":
    sys.exit(entry())
