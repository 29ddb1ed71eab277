"""Triton kernels and their torch reference twins (installed as cotserve.kernels)."""
