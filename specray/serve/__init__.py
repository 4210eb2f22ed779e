"""specray on Ray Serve: ``build_app`` (the application), front ends and the generation
service. Imported lazily: ``specray.serve.protocol`` and the front ends need no Ray."""

from __future__ import annotations


def __getattr__(name: str):
    if name == "build_app":
        from specray.serve.app import build_app

        return build_app
    if name == "AppArgs":
        from specray.serve.config import AppArgs

        return AppArgs
    raise AttributeError(f"module 'specray.serve' has no attribute {name!r}")


__all__ = ["AppArgs", "build_app"]
