"""A stand-in worker for the launcher tests: records its environment, then fails or hangs."""

import json
import os
import sys
import time
from pathlib import Path

out, mode = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
keys = ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "CANNIKIN_SLOWDOWN", "MASTER_PORT")
(out / f"rank{rank}.json").write_text(
    json.dumps({"pid": os.getpid(), **{k: os.environ.get(k) for k in keys}})
)
if mode == "fail" and rank == 1:
    sys.exit(3)
if mode == "hang":
    time.sleep(3600)
