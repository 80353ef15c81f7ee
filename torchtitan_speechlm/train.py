"""One training rank, for torchrun (multi-node jobs):
torchrun --nnodes 2 --nproc-per-node 8 ... -m torchtitan_speechlm.train --job.config_file X
"""

import sys

from torchtitan_speechlm.commands.train import run_worker

if __name__ == "__main__":
    sys.exit(run_worker(sys.argv[1:]))
