"""Tensor parallelism: communicators (NCCL through cffi, in-process for CPU ranks), sharding, and the runner that drives the ranks in lockstep."""
