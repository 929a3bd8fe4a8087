"""Step time of offloaded training vs plain PyTorch (same run); see `infinity bench train --help`.

python bench/train_overhead.py [--layers 8 --hidden 512 --batch-size 4 --json ...]
"""

import sys

from infinity.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "train", *sys.argv[1:]]))
