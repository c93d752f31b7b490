import sys

from torch.distributed.elastic.multiprocessing.errors import record

from pithtrain.cli import main

# `record`: under torchrun a rank's uncaught exception and traceback reach the job's failure summary.
sys.exit(record(main)())
