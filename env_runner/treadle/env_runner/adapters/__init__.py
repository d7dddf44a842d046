"""Adapters: environments written for other libraries, run by Treadle's harnesses,
rubrics and token-exact sessions (``verifiers.py``: environments for ``verifiers``)."""
