"""Helpers shared by the tests: cache inspection, helper processes, synthetic data."""
