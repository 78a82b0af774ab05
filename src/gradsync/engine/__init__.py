"""The engine: bucket assignment, buckets, the Reducer, the hook chain, collectives, the
unused-parameter search, the per-rank reports, errors and the frozen config. It imports nothing
from the layers above; it reports what happened through the iteration timeline it records
(`timeline.IterationTimeline`), which observability and planning read.
"""
