"""``cannikin demo``: a local emulated heterogeneous cluster, trained for real.

The parent process (``run``, ``launch``, ``progress``, ``report``, ``plot``) never imports
torch; the workers (``worker``, ``model``, ``data``) are started by torchrun.
"""
