"""Kernel-shaped operations.

Each module holds the plain-torch reference of one operation; it is the CPU serving path and the
oracle that GPU kernels (``*_triton`` siblings, imported only where a GPU exists) are compared with.
"""
