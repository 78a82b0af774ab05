"""Seeing inside: stats from the recorded timelines, Perfetto traces, the overlap picture, the stall
watchdog and the `gradsync` logger. Reads the engine's records; imports nothing above it.
"""
