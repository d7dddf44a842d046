"""Treadle's wire contracts. Versioned packages live below (``treadle.proto.v1``).

Generated modules (``*_pb2.py``, ``*_pb2.pyi``, ``*_pb2_grpc.py``) are committed and
regenerated only by ``python proto/generate.py``; never edit them by hand.
"""
