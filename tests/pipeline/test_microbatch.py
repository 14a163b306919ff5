"""Tests for pipeline.microbatch: the @smp.step input splitting and output merging rules."""

from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.microbatch import BatchSplitError, merge, split


def _equal(a, b) -> bool:
    """Structural equality with torch.equal on tensors."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


@dataclass
class Ragged:
    """A batch container that knows how to slice itself."""

    rows: list

    def smp_slice(self, num_mb: int, mb: int, axis: int) -> "Ragged":
        per = len(self.rows) // num_mb
        return Ragged(self.rows[mb * per : (mb + 1) * per])


Pair = namedtuple("Pair", "left right")


def test_nested_structures_are_split_and_other_leaves_passed_whole():
    x = torch.arange(12.0).reshape(6, 2)
    batch = {"x": [x, (x[:, 0], "tag")], "pair": Pair(x, 7), "none": None, "scale": torch.tensor(2.0)}
    mbs = split((batch,), {"flag": True}, 3)
    assert len(mbs) == 3
    for mb, (args, kwargs) in enumerate(mbs):
        (part,) = args
        rows = x[2 * mb : 2 * mb + 2]
        assert torch.equal(part["x"][0], rows) and torch.equal(part["x"][1][0], rows[:, 0])
        assert part["x"][1][1] == "tag" and part["none"] is None and kwargs == {"flag": True}
        assert isinstance(part["pair"], Pair) and torch.equal(part["pair"].left, rows) and part["pair"].right == 7
        assert part["scale"] is batch["scale"]  # 0-dim tensors go whole


def test_tensors_need_only_divisibility_not_equal_batch_sizes():
    (a, b), _ = split((torch.zeros(4, 3), torch.zeros(8)), {}, 2)[0]
    assert a.shape == (2, 3) and b.shape == (4,)


def test_leading_axis_splits_are_views_and_others_contiguous_copies():
    x = torch.randn(4, 6)
    (rows,), _ = split((x,), {}, 2)[1]
    assert rows.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    (cols,), _ = split((x,), {}, 2, arg_names=["x"], input_split_axes={"x": 1})[1]
    assert cols.is_contiguous() and torch.equal(cols, x[:, 3:])


def test_gradients_flow_through_split():
    x = torch.randn(4, 2, requires_grad=True)
    sum(args[0].sum() * (mb + 1) for mb, (args, _) in enumerate(split((x,), {}, 2))).backward()
    assert torch.equal(x.grad, torch.tensor([[1.0, 1.0]] * 2 + [[2.0, 2.0]] * 2))


def test_smp_slice_protocol_is_used():
    mbs = split((Ragged(list(range(6))),), {"nested": [Ragged(list("abcdef"))]}, 3)
    assert [args[0].rows for args, _ in mbs] == [[0, 1], [2, 3], [4, 5]]
    assert [kwargs["nested"][0].rows for _, kwargs in mbs] == [["a", "b"], ["c", "d"], ["e", "f"]]


def test_smp_slice_receives_configured_axis():
    seen = []

    class Probe:
        def smp_slice(self, num_mb, mb, axis):
            seen.append((num_mb, mb, axis))
            return mb

    mbs = split((), {"p": Probe()}, 2, input_split_axes={"p": 1})
    assert [kw["p"] for _, kw in mbs] == [0, 1] and seen == [(2, 0, 1), (2, 1, 1)]


def test_non_split_inputs_by_positional_and_keyword_name():
    x, mask, extra = torch.zeros(4, 2), torch.ones(3, 3), torch.ones(5)
    mbs = split((x, mask), {"extra": extra}, 2, arg_names=["x", "mask"], non_split_inputs={"mask", "extra"})
    for args, kwargs in mbs:
        assert args[0].shape == (2, 2) and args[1] is mask and kwargs["extra"] is extra


def test_input_split_axes_by_positional_and_keyword_name():
    mbs = split(
        (torch.zeros(3, 4), torch.zeros(4)),
        {"seq_first": torch.zeros(5, 4, 2)},
        4,
        arg_names=["x", "y"],
        input_split_axes={"x": 1, "seq_first": -2},
    )
    (x, y), kwargs = mbs[0]
    assert x.shape == (3, 1) and y.shape == (1,) and kwargs["seq_first"].shape == (5, 1, 2)


def test_extra_positional_args_without_names_are_split():
    mbs = split((torch.zeros(2), torch.zeros(4)), {}, 2, arg_names=["x"])
    assert [a.shape for a in mbs[0][0]] == [(1,), (2,)]


def test_indivisible_batch_error_names_path_size_axis_count_and_fix():
    with pytest.raises(BatchSplitError) as info:
        split(({"img": [torch.zeros(3, 5)]},), {}, 2, arg_names=["batch"], input_split_axes={"batch": 1})
    message = str(info.value)
    for part in ("batch['img'][0]", "(3, 5)", "size 5", "axis 1", "2 microbatches", "non_split_inputs=['batch']"):
        assert part in message, (part, message)


def test_unnamed_positional_error_suggests_arg_names():
    with pytest.raises(BatchSplitError, match=r"args\[1\].*arg_names"):
        split((torch.zeros(2), torch.zeros(3)), {}, 2)


def test_axis_out_of_range_is_reported():
    with pytest.raises(BatchSplitError, match=r"axis 2.*\(4, 2\)|\(4, 2\).*axis 2"):
        split((), {"x": torch.zeros(4, 2)}, 2, input_split_axes={"x": 2})


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match=r"\['mask'\].*\['x', 'y'\]"):
        split((torch.zeros(2),), {"y": 1}, 2, arg_names=["x"], non_split_inputs=["mask"])


def test_invalid_microbatch_count():
    with pytest.raises(ValueError, match="got 0"):
        split((torch.zeros(2),), {}, 0)


def test_merge_concatenates_nested_and_stacks_scalars():
    outs = [{"y": (torch.full((2, 1), float(mb)),), "loss": torch.tensor(float(mb)), "n": 3} for mb in range(3)]
    merged = merge(outs)
    assert torch.equal(merged["y"][0], torch.tensor([[0.0]] * 2 + [[1.0]] * 2 + [[2.0]] * 2))
    assert torch.equal(merged["loss"], torch.tensor([0.0, 1.0, 2.0])) and merged["n"] == 3


def test_merge_along_axis():
    assert merge([torch.zeros(2, 1), torch.ones(2, 2)], axis=1).shape == (2, 3)


def test_merge_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"microbatch 1 output structure"):
        merge([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])
    with pytest.raises(ValueError, match=r"output\['n'\].*\[1, 2\]"):
        merge([{"n": 1}, {"n": 2}])
    with pytest.raises(ValueError, match="at least one"):
        merge([])


@st.composite
def _batches(draw):
    """A nested input of tensors sharing a split axis, plus the microbatch count and the axis."""
    num_mb = draw(st.integers(1, 4))
    axis = draw(st.integers(0, 2))
    tensors = []
    for _ in range(draw(st.integers(1, 3))):
        shape = draw(st.lists(st.integers(1, 3), min_size=axis + 1, max_size=3))
        shape[axis] *= num_mb
        tensors.append(torch.randn(shape))
    value = {"t": tensors[0], "rest": [(t, i) for i, t in enumerate(tensors[1:])], "name": "x"}
    return value, num_mb, axis


@settings(max_examples=60, deadline=None)
@given(_batches())
def test_merge_inverts_split(case):
    value, num_mb, axis = case
    mbs = split((value,), {"kw": value}, num_mb, arg_names=["value"], input_split_axes={"value": axis, "kw": axis})
    assert len(mbs) == num_mb
    for args, _kwargs in mbs:
        assert args[0]["t"].shape[axis] * num_mb == value["t"].shape[axis] and args[0]["t"].is_contiguous()
    assert _equal(merge([args for args, _ in mbs], axis=axis), (value,))
    assert _equal(merge([kwargs for _, kwargs in mbs], axis=axis), {"kw": value})
