"""Fixtures: mqtt (see conftest.py)."""
