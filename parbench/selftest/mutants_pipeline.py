"""Realistic bugs in the pipeline family (see mutants_data)."""
