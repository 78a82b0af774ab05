"""Every keyword of torch's DDP constructor given a wrong type or value: gradsync's wrapper raises
an error that names the keyword and shows the value, before it touches the process group (a
group that fails the test if any of its methods is called stands in for one)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn
from torch.distributed import GroupMember
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel as GradsyncDDP


class _NoCollectives:
    """Looks like a process group; any use of it fails the test: the error came too late."""

    def __getattr__(self, name):
        def called(*args, **kwargs):
            raise AssertionError(
                f"the process group's {name}() was called before the argument was checked"
            )

        return called


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


_PARAM = nn.Parameter(torch.ones(2))

# (keyword, bad value, exception type, what the message must say besides the keyword)
BAD = [
    ("module", None, TypeError, "must be a torch.nn.Module, got NoneType"),
    ("module", len, TypeError, "must be a torch.nn.Module"),
    ("module", "lazy", RuntimeError, "not initialised yet"),
    ("device_ids", 5, TypeError, "expected a list of one device"),
    ("device_ids", "cuda:0", TypeError, "expected a list of one device"),
    ("device_ids", [0, 1], ValueError, "only applies to a module on a single accelerator"),
    ("output_device", "nonsense", ValueError, "only applies to a module on a single accelerator"),
    ("output_device", 3, ValueError, "Pass output_device=None"),
    ("dim", "x", TypeError, "expected an int"),
    ("dim", 1.5, TypeError, "expected an int"),
    ("broadcast_buffers", "yes", TypeError, "expected True or False"),
    ("init_sync", "no", TypeError, "expected True or False"),
    ("process_group", 5, TypeError, "expected a torch.distributed.ProcessGroup"),
    ("process_group", "gloo", TypeError, "expected a torch.distributed.ProcessGroup"),
    (
        "process_group",
        GroupMember.NON_GROUP_MEMBER,
        ValueError,
        "is not a member of the group passed",
    ),
    ("bucket_cap_mb", "abc", TypeError, 'or "auto"'),
    ("bucket_cap_mb", [25], TypeError, "expected a bucket size in MiB"),
    ("bucket_cap_mb", -1, ValueError, "a number >= 0"),
    ("bucket_cap_mb", float("nan"), ValueError, "a number >= 0"),
    ("bucket_cap_mb", float("inf"), ValueError, "a number >= 0"),
    ("find_unused_parameters", "yes", TypeError, "expected True or False"),
    ("find_unused_parameters", 0.5, TypeError, "expected True or False"),
    ("check_reduction", "yes", TypeError, "expected True or False"),
    ("gradient_as_bucket_view", "yes", TypeError, "expected True or False"),
    ("static_graph", [True], TypeError, "expected True or False"),
    ("delay_all_reduce_named_params", 5, ValueError, "go together: pass both or neither"),
    (
        "delay_all_reduce_named_params",
        "pairs with a trigger",
        TypeError,
        "expected a list of (name, parameter) pairs",
    ),
    ("param_to_hook_all_reduce", _PARAM, ValueError, "go together: pass both or neither"),
    (
        "param_to_hook_all_reduce",
        "trigger with pairs",
        ValueError,
        "must be a parameter that requires grad",
    ),
    ("mixed_precision", 5, TypeError, "expected torch's mixed precision config"),
    ("mixed_precision", "bf16", TypeError, "expected torch's mixed precision config"),
    ("device_mesh", 5, TypeError, "expected a torch.distributed.device_mesh.DeviceMesh"),
    ("skip_all_reduce_unused_params", "yes", TypeError, "expected True or False"),
    ("bucket_cap_mb_list", "abc", TypeError, "expected a list of bucket sizes in MiB"),
    ("bucket_cap_mb_list", 5, TypeError, "expected a list of bucket sizes in MiB"),
    ("bucket_cap_mb_list", ["a"], TypeError, "expected a list of bucket sizes in MiB"),
    ("bucket_cap_mb_list", [-1], ValueError, "expected a list of bucket sizes in MiB"),
    ("batched_grad_copy", "yes", TypeError, "expected True or False"),
    ("forward_sync_buffers", "yes", TypeError, "expected True or False"),
]


def _call(keyword, value):
    model = _model()
    kwargs = (
        {} if keyword in ("process_group", "device_mesh") else {"process_group": _NoCollectives()}
    )
    if keyword == "module":
        model = nn.LazyLinear(2) if value == "lazy" else value
    elif value == "pairs with a trigger":
        kwargs.update(delay_all_reduce_named_params=5, param_to_hook_all_reduce=model[1].weight)
    elif value == "trigger with pairs":
        kwargs.update(delay_all_reduce_named_params=list(model[0].named_parameters(prefix="0")),
                      param_to_hook_all_reduce=[1])
    else:
        kwargs[keyword] = value
    GradsyncDDP(model, **kwargs)


@pytest.mark.parametrize(
    ("keyword", "value", "error", "says"), BAD, ids=[f"{k}={v!r:.20}" for k, v, _, _ in BAD]
)
def test_a_wrong_value_is_refused_naming_the_keyword_before_any_collective(
    keyword, value, error, says
):
    with pytest.raises(error) as info:
        _call(keyword, value)
    message = str(info.value)
    assert says in message, message
    if keyword != "module":  # the module is named as "module", its value shown by type
        assert keyword in message, message


def test_the_table_covers_every_keyword_of_torchs_constructor():
    torch_keywords = set(inspect.signature(TorchDDP.__init__).parameters) - {"self"}
    assert set(inspect.signature(GradsyncDDP.__init__).parameters) - {"self"} == torch_keywords
    assert {k for k, *_ in BAD} == torch_keywords


def test_a_lazy_module_is_refused_with_init_sync_off_too():
    with pytest.raises(
        RuntimeError, match=r"weight, bias.*Run one forward on a sample batch first"
    ):
        GradsyncDDP(nn.LazyLinear(2), process_group=_NoCollectives(), init_sync=False)

