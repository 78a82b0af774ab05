"""What a person runs: the `gradsync` command (demo, bench, probe, simulate) and the benchmark
helpers.
"""
