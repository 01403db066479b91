"""Custom operators (CUDA kernels with PyTorch references)."""
