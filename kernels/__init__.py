"""Triton kernels and their launch wrappers: pure tensor functions, no imports from the project."""
