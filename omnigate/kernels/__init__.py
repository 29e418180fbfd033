"""Plain-torch reference implementations of the tensor operations the model engines are built from.

Each op has the interface of the fused kernel that would replace it on an accelerator, so a faster backend can
swap in without touching the engines.
"""
