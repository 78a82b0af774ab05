"""`DistributedDataParallel` and its features around the engine: join, mixed precision, the
delayed all-reduce, guards (divergence), and the restart-safe `init_process_group`.
"""
