"""Fixtures: model (see conftest.py)."""
