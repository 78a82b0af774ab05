"""Pure tests of bucket planning: identical to torch's private assignment on random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync import compute_bucket_assignment_by_size
from gradsync.engine.bucketing import validate_bucket_indices

DTYPES = [torch.float32, torch.float16, torch.float64, torch.bfloat16]


@st.composite
def assignment_inputs(draw, mixed_dtypes: bool):
    n = draw(st.integers(1, 40))
    dtypes = DTYPES if mixed_dtypes else [torch.float32]
    tensors = [
        torch.empty(draw(st.integers(0, 300)), dtype=draw(st.sampled_from(dtypes)))
        for _ in range(n)
    ]
    limits = draw(st.lists(st.integers(0, 2000), min_size=1, max_size=4))
    sparse = draw(st.one_of(st.none(), st.lists(st.booleans(), min_size=n, max_size=n)))
    return tensors, limits, sparse


@settings(max_examples=300, deadline=None)
@given(assignment_inputs(mixed_dtypes=True))
def test_matches_torch_in_parameter_order(inputs):
    tensors, limits, sparse = inputs
    want = dist._compute_bucket_assignment_by_size(tensors, limits, sparse or [])
    assert compute_bucket_assignment_by_size(tensors, limits, sparse) == tuple(want)


@settings(max_examples=300, deadline=None)
@given(assignment_inputs(mixed_dtypes=False), st.randoms(use_true_random=False))
def test_matches_torch_in_ready_order(inputs, rnd):
    tensors, limits, sparse = inputs
    order = list(range(len(tensors)))
    rnd.shuffle(order)
    ordered = [tensors[i] for i in order]
    want = dist._compute_bucket_assignment_by_size(ordered, limits, sparse or [], order)
    assert compute_bucket_assignment_by_size(ordered, limits, sparse, order) == tuple(want)


@settings(max_examples=200, deadline=None)
@given(assignment_inputs(mixed_dtypes=True), st.randoms(use_true_random=False))
def test_mixed_dtypes_in_ready_order_match_torch_up_to_leftover_order(inputs, rnd):
    # With several dtypes and explicit indices, torch emits the partly filled buckets in its
    # hash map's order; the buckets themselves, and the full ones' order, must agree.
    tensors, limits, sparse = inputs
    order = list(range(len(tensors)))
    rnd.shuffle(order)
    ordered = [tensors[i] for i in order]
    want, want_limits = dist._compute_bucket_assignment_by_size(
        ordered, limits, sparse or [], order
    )
    got, got_limits = compute_bucket_assignment_by_size(ordered, limits, sparse, order)
    assert sorted(zip(got, got_limits)) == sorted(zip(want, want_limits))


def test_every_index_lands_in_exactly_one_bucket_of_one_dtype():
    tensors = [torch.empty(10, dtype=DTYPES[i % 3]) for i in range(30)]
    buckets, _ = compute_bucket_assignment_by_size(tensors, [50, 100])
    assert sorted(i for b in buckets for i in b) == list(range(30))
    for b in buckets:
        assert len({tensors[i].dtype for i in b}) == 1


def test_bad_arguments_are_explained():
    t = [torch.empty(3)]
    with pytest.raises(ValueError, match="no tensors"):
        compute_bucket_assignment_by_size([], [10])
    with pytest.raises(ValueError, match="bucket_size_limits is empty"):
        compute_bucket_assignment_by_size(t, [])
    with pytest.raises(ValueError, match="expect_sparse_gradient has 2 entries for 1"):
        compute_bucket_assignment_by_size(t, [10], [True, False])
    with pytest.raises(ValueError, match="tensor 0 is sparse"):
        compute_bucket_assignment_by_size([torch.zeros(2, 2).to_sparse()], [10])


def test_validate_bucket_indices_accepts_a_good_layout():
    params = [torch.zeros(2), torch.zeros(3), torch.zeros(4)]
    assert validate_bucket_indices([[2], (0, 1)], params, ["a", "b", "c"]) == [[2], [0, 1]]
