"""Helpers that only the native schemes use (beside impls/, not in the harness)."""
