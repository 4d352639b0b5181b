"""``executor="ray"``: ``source[i]`` on Ray actors anywhere in a Ray cluster (``RayExecutor``).

Ray is optional (``pip install 'kerasfeed[ray]'``): nothing here imports it
until an executor is made, so ``import kerasfeed`` and worker processes stay
free of it. The modules, one concern each, are listed in ``executor.py``.
"""
