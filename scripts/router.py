#!/usr/bin/env python3
"""Thin entry point: the kvpush router, installed as ``kvpush-router`` (``kvpush.router.cli``)."""
from kvpush.router.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
