"""The engine core: the round loop beside the target, its draft pool and front-end sessions."""
