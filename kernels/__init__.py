"""Triton kernels for the distillation math, each with a torch reference."""
