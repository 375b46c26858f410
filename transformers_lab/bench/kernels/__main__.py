"""``python -m transformers_lab.bench.kernels``: the command line (``cli.main``)."""

import sys

from transformers_lab.bench.kernels.cli import main

if __name__ == "__main__":
    sys.exit(main())
