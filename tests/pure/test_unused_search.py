"""The unused-parameter search answered by the autograd engine from inside backward
(`engine/unused.py::Accumulators`) against the walk of the graph from forward's outputs
(`engine/unused.py::reachable_parameters`), without a process group: the same answer on
generated graphs, a held accumulator made stale and renewed, and where the two differ."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync.engine.unused import (
    Accumulators,
    current_accumulators,
    reachable_parameters,
    route_through_sink,
)


def _engine_answer(
    accumulators: Accumulators, outputs: list[torch.Tensor], loss: torch.Tensor, **backward
):
    """Run backward from `loss`; the engine's answer as the prehook of the outputs' node sees it."""
    (node,) = {t.grad_fn for t in outputs}
    answers = []
    node.register_prehook(lambda _grads: answers.append(accumulators.unused()))
    loss.backward(**backward)
    assert len(answers) == 1, "backward did not run through the outputs' node"
    return answers[0]


def _random_graph(seed: int, n_params: int):
    """Parameters, and forward's outputs routed through the sink: each value an operation on
    one or two earlier ones, some parameters never used, some values only in a branch cut off
    by `detach`, some outputs leaves of the computation and others not."""
    rng = random.Random(seed)
    params = [torch.nn.Parameter(torch.rand(3) + 0.5) for _ in range(n_params)]
    values = [p for p in params if rng.random() < 0.8]
    if not values:
        values = [params[0]]
    for _ in range(rng.randint(1, 12)):
        a, b = rng.choice(values), rng.choice(values)
        op = rng.choice(["add", "mul", "exp", "detach", "sum"])
        if op == "add":
            values.append(a + b)
        elif op == "mul":
            values.append(a * b)
        elif op == "exp":
            values.append(torch.exp(a * 0.1))
        elif op == "detach":
            values.append(a.detach() * 2)
        else:
            values.append(a.sum() * b)
    computed = [v for v in values if v.grad_fn is not None] or [params[0] * 1.0]
    chosen = rng.sample(computed, rng.randint(1, min(3, len(computed))))
    return params, list(route_through_sink(tuple(chosen)))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n_params=st.integers(1, 8))
def test_the_engine_answers_as_the_walk_whenever_backward_runs_through_the_outputs(seed, n_params):
    params, outputs = _random_graph(seed, n_params)
    walked = reachable_parameters(outputs)
    expected = [i for i, p in enumerate(params) if id(p) not in walked]
    accumulators = Accumulators(params)
    loss = sum(out.sum() for out in outputs)
    assert _engine_answer(accumulators, outputs, loss) == expected


def test_an_output_left_out_of_the_loss_still_counts_its_parameters_used():
    # With the sink, an output left out of the loss is still visited (with no gradient):
    # the engine runs its parameters' accumulators too, as the walk calls them reachable.
    head, dead, unused = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    y, aux = route_through_sink((head * 2, dead * 3))
    assert _engine_answer(Accumulators([head, dead, unused]), [y, aux], y.sum()) == [2]


def test_a_held_accumulator_made_stale_by_a_new_dtype_is_looked_up_again():
    lin, spare = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    params = [*lin.parameters(), *spare.parameters()]
    accumulators = Accumulators(params)
    for p in lin.parameters():  # drops the accumulator autograd had made (torch's set_data)
        p.data = p.data.double()
    (out,) = route_through_sink((lin(torch.ones(4, 3, dtype=torch.float64)),))
    assert _engine_answer(accumulators, [out], out.sum()) == [2, 3]
    assert lin.weight.grad.dtype == torch.float64
    # Renewed: the next iteration asks the accumulator the graph now uses.
    (out,) = route_through_sink((lin(torch.ones(4, 3, dtype=torch.float64)),))
    assert _engine_answer(accumulators, [out], out.sum()) == [2, 3]


def test_a_parameter_the_loss_uses_outside_forward_is_used_to_the_engine():
    # The walk from the outputs calls `extra` unused; the engine runs its accumulator. The
    # Reducer keeps torch's answer where it matters (tests/threaded/test_unused_search_wrapper.py).
    inner, extra = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    (out,) = route_through_sink((inner * 2,))
    assert reachable_parameters([out]) == {id(inner)}
    loss = (out * extra.sum()).sum()
    assert _engine_answer(Accumulators([inner, extra]), [out], loss) == []


def test_backward_with_inputs_runs_only_their_accumulators():
    body, head = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    (out,) = route_through_sink(((body * head) * 2,))
    assert _engine_answer(Accumulators([body, head]), [out], out.sum(), inputs=[head]) == [0]
    assert body.grad is None and head.grad is not None


def test_the_batched_look_up_finds_the_nodes_autograd_uses():
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    held = current_accumulators(params)  # made here: none existed yet
    assert [torch.autograd.graph.get_gradient_edge(p).node for p in params] == held
    with torch.no_grad():  # as inside backward, where grad mode is off
        assert current_accumulators(params) == held
    loss = sum((p * 2).sum() for p in params)
    seen = []
    for p in params:
        p.register_post_accumulate_grad_hook(
            lambda t: seen.append(torch.autograd.graph.get_gradient_edge(t).node)
        )
    loss.backward()
    assert sorted(map(id, seen)) == sorted(map(id, held))  # the graph ran exactly the nodes held


def test_the_engine_cannot_be_asked_outside_backward():
    accumulators = Accumulators([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(RuntimeError):
        accumulators.unused()
