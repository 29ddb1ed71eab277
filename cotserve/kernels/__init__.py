"""Kernels and their torch reference twins: Triton decode attention
(CUDA; tested on the CPU through TRITON_INTERPRET=1) and SFI's C++ CPU decode kernels
(`cpu_decode`)."""
