"""Pins for SGLang frame parsing that mutation testing found unpinned
(`make mutation`, scripts/mutation.py)."""
