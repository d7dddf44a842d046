"""Contracts v1: every message that crosses a Treadle service boundary.

Sources: the ``*.proto`` files next to this module. Generated code: ``*_pb2*.py``.
"""
