"""Tensor parallelism: communicators (NCCL through cffi, in-process), sharding, the executor."""
