"""Triton kernels (device code and their thin launchers). Importing this needs triton."""
