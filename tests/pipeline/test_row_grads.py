"""pipeline.row_grads: row slices' gradients summed over a step's microbatches, handed to autograd in the last one."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx

from pipeline.row_grads import RowGradients

SIZES = [3, 4, 5]  # the stage reads the first and last slices; the middle rows belong to another stage


class _Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(sum(SIZES), 6))


def _stage() -> torch.fx.GraphModule:
    """A stage graph as ``merge_weight_slices`` leaves it: one ``split_with_sizes`` of the weight, two chunks read."""
    root = _Head()
    g = torch.fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("weight")
    whole = g.call_function(torch.ops.aten.split_with_sizes.default, (w, SIZES, 0))
    a = g.call_function(torch.nn.functional.linear, (x, g.call_function(operator.getitem, (whole, 0))))
    b = g.call_function(torch.nn.functional.linear, (x, g.call_function(operator.getitem, (whole, 2))))
    g.output(g.call_function(torch.cat, ([a, b], -1)))
    return torch.fx.GraphModule(root, g)


def _microbatches(m: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(2, 6, generator=gen) for _ in range(m)]


def _expected(m: int) -> torch.Tensor:
    gm = _stage()
    for x in _microbatches(m):
        gm(x).square().sum().backward()
    return gm.weight.grad


def test_the_weights_gradient_reaches_grad_once_in_the_last_backward_as_the_sum_over_microbatches():
    m = 4
    gm, rows = _stage(), RowGradients()
    assert rows.insert(gm, 0) == 1
    rows.begin_step()
    for k, x in enumerate(_microbatches(m)):
        rows.final = k == m - 1
        gm(x).square().sum().backward()
        assert (gm.weight.grad is None) == (not rows.final), "one whole gradient per step, not one per microbatch"
    torch.testing.assert_close(gm.weight.grad, _expected(m))
    assert not gm.weight.grad[3:7].any(), "rows the stage does not read get no gradient"
    assert rows.end_step() == 0


@pytest.mark.parametrize("where", ["split backward", "outside a step"])
def test_each_backward_hands_its_own_gradient_over_under_a_split_backward_and_outside_a_step(where):
    gm, rows = _stage(), RowGradients(defer=where != "split backward")
    rows.insert(gm, 0)
    if where == "split backward":
        rows.begin_step()
    for x in _microbatches(3):
        gm(x).square().sum().backward()
        assert gm.weight.grad is not None
    torch.testing.assert_close(gm.weight.grad, _expected(3))
    assert rows.end_step() == 0


def test_a_step_that_never_reaches_its_last_backward_leaves_sums_that_end_step_counts_and_drops():
    gm, rows = _stage(), RowGradients()
    rows.insert(gm, 0)
    rows.begin_step()
    gm(_microbatches(1)[0]).sum().backward()
    assert gm.weight.grad is None
    assert rows.end_step() == 1
    assert rows.end_step() == 0, "the next step starts from nothing"


@pytest.mark.parametrize("what", ["frozen", "activation"])
def test_only_splits_of_trainable_parameters_are_routed(what):
    gm = _stage()
    if what == "frozen":
        gm.weight.requires_grad_(False)
    else:  # a split of a value the graph computed, not of a parameter
        node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.split_with_sizes.default)
        with gm.graph.inserting_before(node):
            node.args = (gm.graph.call_function(torch.neg, (node.args[0],)), *node.args[1:])
        gm.recompile()
    assert RowGradients().insert(gm, 0) == 0


def _lookup_stage(padding_idx: int | None) -> torch.fx.GraphModule:
    """A first stage: an embedding lookup (``aten.embedding``, as traced) of a trainable table, then a matmul."""
    torch.manual_seed(0)
    root = torch.nn.Module()
    root.table = torch.nn.Parameter(torch.randn(11, 4))
    g = torch.fx.Graph()
    ids = g.placeholder("ids")
    args = (g.get_attr("table"), ids) + (() if padding_idx is None else (padding_idx,))
    out = g.call_function(torch.ops.aten.embedding.default, args)
    g.output(g.call_function(torch.mul, (out, out)))
    return torch.fx.GraphModule(root, g)


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_an_embeddings_gradient_is_summed_over_microbatches_and_handed_over_once(padding_idx):
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(11, (2, 5), generator=gen) for _ in range(3)]
    ref = _lookup_stage(padding_idx)
    for ids in batches:
        ref(ids).sum().backward()
    gm, rows = _lookup_stage(padding_idx), RowGradients()
    assert rows.insert(gm, 0) == 1
    rows.begin_step()
    for k, ids in enumerate(batches):
        rows.final = k == len(batches) - 1
        gm(ids).sum().backward()
        assert (gm.table.grad is None) == (not rows.final)
    torch.testing.assert_close(gm.table.grad, ref.table.grad)
    if padding_idx is not None:
        assert not gm.table.grad[padding_idx].any() and bool((torch.cat(batches) == padding_idx).any())
    assert rows.end_step() == 0


def test_an_embedding_scaled_by_frequency_is_left_as_it_is():
    gm = _lookup_stage(None)
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.embedding.default)
    node.args = (*node.args, -1, True)
    gm.recompile()
    assert RowGradients().insert(gm, 0) == 0


@pytest.mark.parametrize("what", ["slices", "lookup"])
def test_a_last_microbatch_that_backpropagates_nothing_loses_no_earlier_gradient(what):
    """A step function that skips ``model.backward`` for its last microbatch (a NaN loss, say): the stage's last
    backward hands nothing over, and the executor's flush at its end does."""
    gm, rows = (_stage(), RowGradients()) if what == "slices" else (_lookup_stage(None), RowGradients())
    ref = _stage() if what == "slices" else _lookup_stage(None)
    x = _microbatches(1)[0] if what == "slices" else torch.randint(11, (2, 5), generator=torch.Generator())
    ref(x).square().sum().backward()
    rows.insert(gm, 0)
    rows.begin_step()
    gm(x).square().sum().backward()
    rows.final = True
    gm(x)  # the last microbatch's forward; its loss is never backpropagated
    assert gm.weight.grad is None if what == "slices" else gm.table.grad is None
    rows.flush(0)
    weight = gm.weight if what == "slices" else gm.table
    torch.testing.assert_close(weight.grad, ref.weight.grad if what == "slices" else ref.table.grad)
    assert rows.end_step() == 0
