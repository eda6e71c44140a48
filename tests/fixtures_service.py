"""Fixtures: service (see conftest.py)."""
