"""``executor="ray"``: ``source[i]`` on Ray actors anywhere in a Ray cluster (``RayExecutor``).

Ray is optional (``pip install 'kerasfeed[ray]'``) and imported only once an executor is made, so
``import kerasfeed`` and worker processes stay free of it. ``executor.py`` lists the modules.
"""
