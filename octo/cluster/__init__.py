"""Scale-out with Ray Serve: each model a deployment whose replicas run an ordinary model handle.

The only Ray code in octo; importing this package does not import ray (that happens when a cluster starts).
"""
