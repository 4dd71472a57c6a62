"""Thin adapters around DeepSpeed's and PyTorch's own implementations."""
