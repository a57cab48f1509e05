"""The inference engine: synchronous, blocking code that knows nothing of trio, HTTP or NCCL.

It is driven from a worker thread by the model actor (service layer).
"""
