"""partitioner.capture.chunk: an LM head heavier than a stage's share, computed in column chunks the stages share."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from partitioner import DeviceRates, PartitionOptions, PartitionPlan, partition, trace
from partitioner.capture.chunk import heavy_linears, split_columns
from partitioner.cut.portfolio import fixed_plan, make_problem
from smp.testing import run_ranks

VOCAB, SEQ = 32768, 16


def _gpt2(seed: int = 0):
    """A GPT-2 whose tied LM head is most of the work: vocabulary 32,768, hidden 32, 2 layers."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, use_cache=False)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = GPT2LMHeadModel(cfg)

        def forward(self, ids):
            return self.model(input_ids=ids).logits

    ids = torch.randint(VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(1))
    return Logits(), ids, torch.roll(ids, -1, 1)


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


FAST = DeviceRates(link_bytes_per_s=1e12)  # an NVLink-class link: the chunks' outputs cross it for free


def _split_plan(model, ids, rates=FAST):
    options = PartitionOptions(rates=rates, split_heavy_linears=True, microbatches=2)
    return partition(trace(model, (ids[:2],)), 2, options)


def test_a_heavy_head_is_split_and_the_stages_compute_the_models_outputs_and_gradients():
    model, ids, target = _gpt2()
    plan = _split_plan(model, ids)
    assert list(plan.split_ops) == ["linear"] and plan.split_ops["linear"] >= 4, plan.split_ops
    assert PartitionPlan.from_json(plan.to_json()).split_ops == plan.split_ops
    stage = plan.stage_of_ops(plan.graph)
    chunks = [stage[plan.graph.names.index(f"linear_cols{i}")] for i in range(plan.split_ops["linear"])]
    assert set(chunks) == {0, 1}, f"the chunks should be spread over both stages: {chunks}"
    # Balance is what the split buys: the unsplit plan's bottleneck is the head's stage.
    unsplit = partition(trace(model, (ids[:2],)), 2, rates=FAST, microbatches=2, split_heavy_linears=False)
    assert unsplit.split_ops == {} and plan.bottleneck < unsplit.bottleneck
    costs, before = [s.cost_s for s in plan.stages], [s.cost_s for s in unsplit.stages]
    assert max(costs) / min(costs) < 1.1 and max(before) / min(before) > 1.5, (costs, before)
    # Over a slow link the chunks' outputs cost more than the balance gains: the unsplit plan is kept.
    slow = _split_plan(model, ids, DeviceRates(link_bytes_per_s=1e8))
    assert slow.split_ops == {} and "linear" in slow.graph.names

    staged = plan.as_module()
    x = ids[:2]
    _loss(model(x), target[:2]).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    out = staged(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    _loss(out, target[:2]).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_each_stage_reads_one_split_of_the_weight_not_a_slice_per_chunk():
    model, ids, _ = _gpt2()
    graph = split_columns(trace(model, (ids[:2],)), {"linear": 4})
    first = graph.names.index("linear_cols2_weight")  # chunks 0, 1 on stage 0; 2, 3 on stage 1
    plan = fixed_plan(graph, 2, [0 if i < first else 1 for i in range(graph.num_nodes)], rates=DeviceRates())
    for st in plan.stage_modules():
        of_head = [n.target for n in st.module.graph.nodes if n.op == "call_function" and n.args
                   and isinstance(n.args[0], torch.fx.Node) and n.args[0].target == "model.lm_head.weight"]
        assert torch.ops.aten.slice.Tensor not in of_head, of_head
        assert of_head.count(torch.ops.aten.split_with_sizes.default) == 1, of_head
    # The estimate charges each chunk's slice its share of the weight's gradient, not the whole weight.
    p = make_problem(graph, 2, rates=DeviceRates())
    slices = [graph.names.index(f"linear_cols{i}_weight") for i in range(4)]
    whole = make_problem(trace(model, (ids[:2],)), 2, rates=DeviceRates())
    head = whole.graph.names.index("linear")
    chunk_matmuls = p.costs.backward_s[slices[0] + 1] * 4
    assert sum(p.costs.backward_s[slices]) < 1.1 * (whole.costs.backward_s[head] - chunk_matmuls)


def test_a_plan_with_split_ops_binds_to_a_fresh_trace_and_names_what_does_not_fit():
    model, ids, _ = _gpt2()
    plan = PartitionPlan.from_json(_split_plan(model, ids).to_json())
    bound = plan.bind(trace(model, (ids[:2],)), num_stages=2)
    assert "linear_cols0" in bound.graph.names and len(bound.stage_modules()) == 2
    with pytest.raises(ValueError, match=r"cannot split 'nope' into 2 column chunks: .* no linear layer"):
        split_columns(trace(model, (ids[:2],)), {"nope": 2})


def test_on_by_default_kept_only_where_better_and_never_for_one_stage():
    model, ids, _ = _gpt2()
    graph = trace(model, (ids[:2],))
    assert PartitionOptions().split_heavy_linears
    # the default profile's link prices the chunks' logits above what the balance gains: the unsplit plan stays
    assert partition(graph, 2, rates=DeviceRates()).split_ops == {}
    p = make_problem(graph, 1, rates=DeviceRates())
    assert heavy_linears(graph, p.time, 1) == {} and set(heavy_linears(graph, p.time, 2)) == {"linear"}


def _two_ranks(rank: int, world: int, schedule: str) -> list[str]:
    from pipeline import PipelineRunner, microbatch

    model, ids, target = _gpt2()
    m = 2
    model.zero_grad(set_to_none=True)
    losses = []
    for (a, _), t in zip(microbatch.split((ids,), {}, m), microbatch.split((target,), {}, m)):
        loss = _loss(model(*a), t[0][0])
        (loss / m).backward()
        losses.append(float(loss))
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    runner = PipelineRunner(_split_plan(model, ids), schedule=schedule, microbatches=m, timeout_s=60)
    res = runner.step((ids,), target=target, loss_fn=_loss)
    errors = [] if torch.allclose(torch.tensor(res.losses), torch.tensor(losses), rtol=1e-5) else [
        f"losses {res.losses} != {losses}"]
    names = {id(p): n for n, p in model.named_parameters()}
    for p in runner.local_parameters():
        if p.grad is None or not torch.allclose(p.grad, want[names[id(p)]], rtol=1e-4, atol=1e-6):
            errors.append(f"rank {rank}: gradient of {names[id(p)]} differs")
    runner.close()
    return errors


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("zb-h1", marks=pytest.mark.slow)])
def test_a_split_head_trains_on_two_ranks_like_one_process(schedule):
    errors = run_ranks(_two_ranks, 2, schedule, timeout=180)
    assert errors == [[], []], "\n".join(sum(errors, []))
