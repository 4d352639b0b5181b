"""Keeps every item of a process pool alive under a low fd limit; prints JSON.

Workers start first (with the normal limit); then this process's soft
RLIMIT_NOFILE is lowered, so that the segments it maps run into it.
"""

import json
import os
import resource

import numpy as np

from kerasfeed.execution.processes.executor import ProcessExecutor


class Big:
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        return np.full(300_000, i % 7, np.float32)  # 1.2 MB: lent, one segment each while kept


ex = ProcessExecutor(Big(), workers=2)
ex.wait_ready(120)
limit = len(os.listdir("/proc/self/fd")) + 12  # room for ~12 segments; a pool wants up to 36
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
kept, error = [], None
try:
    for i in range(400):
        kept.append(ex.load(i, 0))
except Exception as e:  # noqa: BLE001 - reported
    error = f"{type(e).__name__}: {e}"
ex.close()
print(json.dumps({"kept": len(kept), "error": error, "limit": limit}))
