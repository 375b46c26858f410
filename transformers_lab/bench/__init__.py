"""Benchmarks of the attention kernels.

``python -m transformers_lab.bench.kernels --help`` times forward+backward and measures the
extra peak memory of every kernel against sequence length. This package imports nothing on
purpose, so that ``python -m`` runs each benchmark module exactly once.
"""
