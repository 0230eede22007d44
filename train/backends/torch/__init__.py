"""PyTorch backend."""
