"""The tensor operations the model engines are built from.

Each op module holds a plain-torch reference (the CPU fallback) and a dispatcher that runs the Triton kernel from
:mod:`omnigate.kernels.triton_kernels` for CUDA tensors where Triton is installed (:mod:`omnigate.kernels.backend`).
"""
