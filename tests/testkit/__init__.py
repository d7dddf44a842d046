"""Test kit shared by every test folder: real servers started on free ports, paths to
test assets, and helpers. Fixtures that wrap these live in tests/conftest.py."""
