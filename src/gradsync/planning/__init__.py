"""Planned buckets: the cost model and its probes, the bucket planner, the simulator, and
`AutoBuckets`, which plans and tries layouts on a running Reducer.
"""
