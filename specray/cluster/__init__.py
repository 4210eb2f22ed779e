"""Cluster side: placement, starting and supervising the worker processes
(:mod:`specray.cluster.distributed`), and the autoscaling policies."""
