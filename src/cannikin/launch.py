"""``python -m cannikin.launch ...`` is ``cannikin launch ...``: torchrun with Cannikin's defaults.

See :mod:`cannikin.cli.launch`.
"""

import sys

from cannikin.cli import main

if __name__ == "__main__":
    sys.exit(main(["launch", *sys.argv[1:]]))
