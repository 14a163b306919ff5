"""Expert parallelism found on the traced graph (:mod:`partitioner.ep.experts`) and one ep rank's program
(:mod:`partitioner.ep.expert_program`): the routing pattern in ``transformers``' Mixtral and in a plain module a user
writes, what is left whole and why, the errors, the price of the all-to-alls, and two spawned ranks whose experts
each hold half the weights computing what one process computes."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner import trace
from partitioner.capture.flops import is_matmul_class
from partitioner.cost.devices import profile
from partitioner.cost.roofline import estimate
from partitioner.ep.expert_program import ep_degree, expert_parallel_graph
from partitioner.ep.experts import find_experts
from smp.testing import run_ranks
from tests.smp.test_expert_parallel import moe_model


class PlainMoE(nn.Module):
    """A mixture of experts as torchtitan writes one: a router, top-k, experts as grouped matmuls over the rows
    sorted by expert, the results weighted back into the tokens; then a head."""

    def __init__(self, dim: int = 16, hidden: int = 24, experts: int = 4, k: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter((torch.randn(experts, hidden, dim) * 0.2).bfloat16())
        self.w2 = nn.Parameter((torch.randn(experts, dim, hidden) * 0.2).bfloat16())
        self.head = nn.Linear(dim, 4)
        self.k, self.experts = k, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x).softmax(-1).topk(self.k, dim=-1)
        sorted_ids, perm = ids.reshape(-1).sort()
        rows = x[perm // self.k]
        offsets = torch.histc(sorted_ids.float(), bins=self.experts, min=0, max=self.experts - 1).cumsum(0)
        offsets = offsets.to(torch.int32)
        # torch's grouped matmul traces in bfloat16 only (its meta kernel); the rest of the model stays float32
        h = F.silu(torch._grouped_mm(rows.bfloat16(), self.w1.transpose(-2, -1), offs=offsets)).float()
        y = torch._grouped_mm(h.bfloat16(), self.w2.transpose(-2, -1), offs=offsets).float()
        back = torch.zeros_like(y).index_copy(0, perm, y)
        return self.head(x + (back.view(-1, self.k, x.shape[-1]) * weights.unsqueeze(-1)).sum(1))


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(32, 16, generator=torch.Generator().manual_seed(10 + rank))


def test_mixtral_layers_are_found_with_their_router_and_top_k():
    ids = torch.randint(0, 128, (2, 16))
    found = find_experts(trace(moe_model("mixtral"), (ids,), {"labels": ids}).fx.module)
    assert [x.name for x in found.layers] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    layer = found.layers[0]
    assert (layer.experts, layer.top_k, layer.router) == (4, 2, "model.layers.0.mlp.gate.weight")
    assert layer.params == ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")
    assert not found.skipped


def test_a_plain_module_moe_is_found():
    found = find_experts(trace(PlainMoE(), (_tokens(0),)).fx.module)
    assert [(x.experts, x.top_k, x.router, x.params) for x in found.layers] == [(4, 2, "router.weight", ("w1", "w2"))]


def test_gpt_oss_biases_per_expert_are_split_with_the_weights():
    found = find_experts(trace(moe_model("gpt_oss"), (torch.randint(0, 128, (2, 8)),)).fx.module)
    layer = found.layers[0]
    assert "model.layers.0.mlp.experts.gate_up_proj_bias" in layer.params and layer.ids is not None
    assert "model.layers.0.mlp.experts.down_proj_bias" not in layer.params  # added after the experts, by every rank


def test_experts_that_read_more_than_rows_and_weights_are_left_whole_and_say_why():
    class Scaled(PlainMoE):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            weights, ids = self.router(x).softmax(-1).topk(self.k, dim=-1)
            sorted_ids, perm = ids.reshape(-1).sort()
            offsets = torch.histc(sorted_ids.float(), bins=self.experts, min=0, max=self.experts - 1).cumsum(0).int()
            h = torch._grouped_mm(x[perm // self.k].bfloat16(), self.w1.transpose(-2, -1), offs=offsets)
            h = h.float() * x.mean()  # inside the experts, a value of every token: not the rows' own
            y = torch._grouped_mm(h.bfloat16(), self.w2.transpose(-2, -1), offs=offsets)
            return self.head(y.float().view(-1, self.k, x.shape[-1]).sum(1))

    found = find_experts(trace(Scaled(), (_tokens(0),)).fx.module)
    assert found.layers == []
    assert "which is neither the rows, the experts' weights nor their ids" in str(found.skipped), found.skipped


def test_a_degree_that_does_not_divide_the_experts_or_a_dense_model_is_refused():
    graph = trace(PlainMoE(), (_tokens(0),))
    with pytest.raises(ValueError, match=r"expert_parallel_degree=3 does not divide the \[4\] experts"):
        expert_parallel_graph(graph, 3, 0)
    with pytest.raises(ValueError, match="no mixture-of-experts layer"):
        expert_parallel_graph(trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),)), 2, 0)


def test_each_rank_holds_its_experts_and_the_ops_keep_their_flops():
    graph = trace(PlainMoE(), (_tokens(0),))
    half = expert_parallel_graph(graph, 2, 1)
    assert ep_degree(half) == 2 and ep_degree(graph) == 1
    assert half.fx.module.get_parameter("w1").shape == (2, 24, 16)
    assert torch.equal(half.fx.module.get_parameter("w1"), graph.fx.module.get_parameter("w1")[2:4])
    assert half.fx.experts.params["w1"] == (2, 4, 4)
    # one op per layer stands for the experts, priced as the region (grouped matmuls by the rows they multiply)
    assert half.flops.sum() == pytest.approx(graph.flops.sum())
    rates = profile("h100-80gb")
    whole, split = estimate(graph, rates), estimate(half, rates)
    assert split.tp_comm_s.sum() > 0 and whole.tp_comm_s.sum() == 0
    # ... at the tensor-core rate of the grouped matmuls it stands for (priced elementwise, an ep layout of Mixtral
    # 8x7B took 9x its step)
    regions = [k for k in half.kinds if k.endswith("expert_parallel")]
    assert regions and all(is_matmul_class(k.rpartition(".")[2]) for k in regions)


def _run_plain(rank: int, world: int) -> dict:
    import torch.distributed as dist

    model, reference = PlainMoE(), PlainMoE()
    graph = expert_parallel_graph(trace(model, (_tokens(rank),)), 2, rank)
    graph.fx.ep_comm.bind(dist.group.WORLD)
    out = graph.fx.module(_tokens(rank))
    out.square().sum().backward()
    want = [reference(_tokens(r)) for r in range(2)]
    sum(w.square().sum() for w in want).backward()
    a, b, _ = graph.fx.experts.params["w1"]
    return {"out": float((out - want[rank]).abs().max()),
            "w1": float((graph.fx.module.get_parameter("w1").grad - reference.w1.grad[a:b]).float().abs().max()
                        / reference.w1.grad[a:b].float().abs().max())}


@pytest.mark.slow
def test_two_ranks_compute_what_one_process_computes():
    for got in run_ranks(_run_plain, 2, timeout=120):
        assert got["out"] < 1e-5 and got["w1"] < 1e-2, got  # w1's gradient: bfloat16, relative
