"""Tracing models into op graphs: structure, costs, parameters, folding, and the traced program itself."""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import partitioner
from partitioner.capture.stage_modules import split
from partitioner.cost.roofline import estimate
from partitioner.cost.timing import measure_stages
from partitioner.cut.baselines import block_index
from smp import zoo
from tests.conftest import tensor_leaves


@pytest.fixture(scope="module", params=zoo.NAMES)
def zoo_graph(request):
    zm = zoo.build(request.param, batch=2)
    state = {k: v.clone() for k, v in zm.model.state_dict().items()}
    g = partitioner.trace(zm.model, zm.args, zm.kwargs)
    return zm, g, state


# --- a model small enough to check by hand -------------------------------------------------------------


def test_mlp_graph_by_hand():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    g = partitioner.trace(model, (torch.randn(8, 64),))
    assert g.names == ["linear", "relu", "linear_1", "output"]
    assert g.kinds == ["aten.linear", "aten.relu", "aten.linear", "output"]
    assert g.modules == ["0", "1", "2", ""]
    assert g.flops.tolist() == [2 * 8 * 64 * 32, 8 * 32, 2 * 8 * 32 * 10, 0]
    assert g.out_bytes.tolist() == [8 * 32 * 4, 8 * 32 * 4, 8 * 10 * 4, 0]
    # A chain: one value per producer, read by the next op.
    assert g.src.tolist() == [0, 1, 2] and g.dst.tolist() == [1, 2, 3] and g.value.tolist() == [0, 1, 2]
    assert g.value_bytes.tolist() == [1024, 1024, 320]
    assert g.param_names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert g.param_bytes.tolist() == [64 * 32 * 4, 32 * 4, 32 * 10 * 4, 10 * 4]
    assert g.param_trainable.all()
    assert sorted(zip(g.use_node.tolist(), g.use_param.tolist())) == [(0, 0), (0, 1), (2, 2), (2, 3)]
    assert g.node_param_bytes().tolist() == [64 * 32 * 4 + 32 * 4, 0, 32 * 10 * 4 + 40, 0]
    assert g.fx.input_names == ["input"] or len(g.fx.input_names) == 1
    assert "4 ops" in g.describe()


def test_conv_and_matmul_flops():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)

        def forward(self, x, w):
            y = self.dw(self.conv(x))
            return torch.bmm(y.flatten(2), w)

    x, w = torch.randn(2, 3, 16, 16), torch.randn(2, 256, 5)
    g = partitioner.trace(Net(), (x, w))
    flops = dict(zip(g.names, g.flops.tolist()))
    assert flops["conv2d"] == 2 * (2 * 8 * 16 * 16) * (3 * 3 * 3)
    assert flops["conv2d_1"] == 2 * (2 * 8 * 16 * 16) * (1 * 3 * 3)  # depthwise: one input channel per output
    assert flops["bmm"] == 2 * (2 * 8 * 5) * 256
    kinds = dict(zip(g.names, g.kinds))
    view = [n for n, k in kinds.items() if k in ("aten.flatten", "aten.view")]
    assert view and all(flops[n] == 0 for n in view)
    assert all(g.act_bytes[g.names.index(n)] == 0 for n in view)  # views keep nothing alive


def test_attention_flops_count_both_matmuls():
    q = torch.randn(2, 4, 16, 8)
    g = partitioner.trace(_Attention(), (q,))
    i = next(i for i, k in enumerate(g.kinds) if "scaled_dot_product" in k)
    b, s, d = 2 * 4, 16, 8
    assert g.flops[i] == 4.0 * b * s * s * d + 5.0 * b * s * s


class _Attention(nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q)


# --- every zoo model -----------------------------------------------------------------------------------


def test_zoo_graph_is_topological_and_consistent(zoo_graph):
    zm, g, _ = zoo_graph
    n = g.num_nodes
    assert n > 5 and len(g.names) == len(set(g.names))
    assert np.all(g.src < g.dst) and g.src.min() >= 0 and g.dst.max() < n
    assert g.kinds[-1] == "output" and g.kinds.count("output") == 1
    # Edges are deduplicated per (src, dst, value); a value has one producer.
    triples = set(zip(g.src.tolist(), g.dst.tolist(), g.value.tolist()))
    assert len(triples) == g.num_edges
    producer = {}
    for s, v in zip(g.src.tolist(), g.value.tolist()):
        assert producer.setdefault(v, s) == s
    assert set(g.value.tolist()) == set(range(len(g.value_bytes)))
    assert np.all(g.flops >= 0) and np.all(g.value_bytes >= 0)
    # What autograd saves (partitioner.capture.autograd_saves): an op may keep its input rather than its output, but
    # every
    # saved storage is an op's output, a model input or a buffer no larger than one (a dropout mask, norm statistics).
    assert np.all(g.act_bytes >= 0) and np.all(g.act_float_bytes <= g.act_bytes)
    assert g.act_bytes.sum() <= 2 * g.out_bytes.sum() + sum(v.numel() * v.element_size() for v in g.fx.input_meta
                                                            if isinstance(v, torch.Tensor))
    # The output op reads every value the model returns.
    assert g.dst.max() == n - 1


def test_zoo_every_fx_node_belongs_to_one_op(zoo_graph):
    _, g, _ = zoo_graph
    fx = g.fx
    calls = [node.name for node in fx.module.graph.nodes if node.op in ("call_function", "output")]
    assert set(calls) <= set(fx.op_of)
    members = [m for ms in g.members for m in ms]
    assert len(members) == len(set(members)) and set(members) == set(calls)
    for i, ms in enumerate(g.members):
        assert g.names[i] in ms and all(fx.op_of[m] == i for m in ms)


def test_zoo_module_paths_are_real_submodules(zoo_graph):
    zm, g, _ = zoo_graph
    for path in set(g.modules) - {""}:
        zm.model.get_submodule(path)
    _, block = block_index(g.modules)
    assert block.max() >= 1  # the repeated blocks are visible to the "layers" baseline


def test_zoo_parameters_are_keyed_once(zoo_graph):
    zm, g, _ = zoo_graph
    model = zm.model
    tensors = {id(t): (n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    assert len(g.param_names) == len(set(g.param_names)) == len(tensors)
    assert int(g.param_bytes.sum()) == sum(t.numel() * t.element_size() for _, t in tensors.values())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n for n, t in zip(g.param_names, g.param_trainable) if t} == trainable
    used = set(g.use_param.tolist())
    assert all(q in used for q, n in enumerate(g.param_names) if n in trainable), "a trainable parameter no op uses"


def test_zoo_trace_leaves_the_model_alone(zoo_graph):
    zm, g, state = zoo_graph
    assert zm.model.training
    after = zm.model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)


def test_zoo_traced_program_reproduces_the_model(zoo_graph):
    zm, g, _ = zoo_graph
    with torch.no_grad():
        saved = {k: v.clone() for k, v in zm.model.state_dict().items()}
        want = tensor_leaves(zm.model(*zm.args, **zm.kwargs))
        zm.model.load_state_dict(saved)
        got = tensor_leaves(g.fx.module(*zm.args, **zm.kwargs))
        zm.model.load_state_dict(saved)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_zoo_costs_are_positive_where_it_matters(zoo_graph):
    _, g, _ = zoo_graph
    c = estimate(g, partitioner.DeviceRates())
    ops = np.array([k != "output" for k in g.kinds])
    assert np.all(c.forward_s[ops] > 0) and np.all(c.forward_s[~ops] == 0)
    assert np.all(c.backward_s >= 0) and c.backward_s.sum() > c.forward_s.sum()
    assert c.needs_grad.any()


# --- folding -------------------------------------------------------------------------------------------


def test_batchnorm_counter_update_joins_the_batchnorm():
    """``num_batches_tracked += 1`` reads no op, so it joins the op that uses the same buffer: a mutated
    buffer never lands on two stages."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    g = partitioner.trace(model, (torch.randn(2, 3, 8, 8),))
    bn = g.kinds.index("aten.batch_norm")
    assert any(m.startswith("add_") for m in g.members[bn])
    counter = g.param_names.index("1.num_batches_tracked")
    assert g.use_node[g.use_param == counter].tolist() == [bn]
    for name in ("1.running_mean", "1.running_var"):
        assert g.use_node[g.use_param == g.param_names.index(name)].tolist() == [bn]
    assert not g.param_trainable[counter]


def test_tuple_outputs_are_folded_into_their_op():
    class Split(nn.Module):
        def forward(self, x):
            a, b = torch.chunk(x * 2, 2, dim=-1)
            return a + 1, b - 1

    g = partitioner.trace(Split(), (torch.randn(3, 8),))
    assert not any(k == "getitem" for k in g.kinds)
    assert all(k.startswith("aten.") or k == "output" for k in g.kinds)


def test_shared_module_is_one_parameter_used_by_two_ops():
    zm = zoo.build("inception", batch=2)
    g = partitioner.trace(zm.model, zm.args)
    q = g.param_names.index("blocks.0.shared.weight")
    users = g.use_node[g.use_param == q]
    assert len(users) == 2 and all(g.modules[u] == "blocks.0.shared" for u in users)


def test_frozen_parameters_have_no_backward():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen = nn.Linear(16, 16)
            self.frozen.requires_grad_(False)
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(torch.relu(self.frozen(x)))

    g = partitioner.trace(Net(), (torch.randn(4, 16),))
    c = estimate(g, partitioner.DeviceRates())
    by_module = dict(zip(g.modules, range(g.num_nodes)))
    assert c.backward_s[by_module["frozen"]] == 0 and not c.needs_grad[by_module["frozen"]]
    assert c.backward_s[by_module["head"]] > 0
    assert not g.param_trainable[g.param_names.index("frozen.weight")]


def test_keyword_tensor_inputs_are_graph_inputs():
    zm = zoo.build("bert", batch=2)
    g = partitioner.trace(zm.model, zm.args, zm.kwargs)
    assert g.fx.input_names == ["input_ids", "attention_mask"]
    assert [tuple(m.shape) for m in g.fx.input_meta] == [(2, 32), (2, 32)]


def test_dict_output_keeps_its_structure():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x, *, scale):
            h = self.a(x)
            return {"logits": self.b(h) * scale, "hidden": h}

    model, x = Net(), torch.randn(4, 8)
    plan = partitioner.partition(model, 2, example_inputs=(x,), example_kwargs={"scale": torch.tensor(2.0)})
    out = plan.as_module()(x, scale=torch.tensor(2.0))
    want = model(x, scale=torch.tensor(2.0))
    assert isinstance(out, dict) and out.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(out[k], want[k], rtol=0, atol=0)


def test_args_need_not_be_a_tuple():
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    g1 = partitioner.trace(model, x)
    g2 = partitioner.trace(model, (x,))
    assert g1.names == g2.names and g1.flops.tolist() == g2.flops.tolist()


# --- the cost model ------------------------------------------------------------------------------------


def _two_layer():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def test_backward_costs_only_the_gradients_needed():
    """The first layer computes no input gradient (its input is data): 1x its forward compute, not 2x;
    every weight gradient is a fresh tensor written at ``grad_bytes_per_s``."""
    g = partitioner.trace(_two_layer(), (torch.randn(16, 32),))
    rates = partitioner.DeviceRates(grad_bytes_per_s=float("inf"))
    c = estimate(g, rates)
    compute = np.maximum(g.flops / rates.flops_per_s, g.move_bytes / rates.bytes_per_s)
    first, relu, second = (g.names.index(n) for n in ("linear", "relu", "linear_1"))
    assert c.backward_s[first] == pytest.approx(compute[first] + rates.op_overhead_s)
    assert c.backward_s[relu] == pytest.approx(2 * compute[relu] + rates.op_overhead_s)
    assert c.backward_s[second] == pytest.approx(2 * compute[second] + rates.op_overhead_s)
    slow = dataclasses.replace(rates, grad_bytes_per_s=1e6)
    extra = estimate(g, slow).backward_s - c.backward_s
    assert extra[first] == pytest.approx((32 * 64 + 64) * 4 / 1e6)
    assert extra[second] == pytest.approx((64 * 8 + 8) * 4 / 1e6)
    assert extra[relu] == 0
    assert np.array_equal(estimate(g, slow).forward_s, c.forward_s)  # forward is unchanged


def test_calibrated_rates_are_sane():
    r = partitioner.calibrate()
    assert r is partitioner.calibrate()  # cached: one measurement per process
    assert 1e8 < r.flops_per_s < 1e15 and 1e8 < r.bytes_per_s < 1e13
    assert 1e7 < r.grad_bytes_per_s < 1e13 and 0 < r.op_overhead_s < 1e-3
    assert set(r.to_dict()) >= {"flops_per_s", "bytes_per_s", "grad_bytes_per_s", "op_overhead_s",
                                "link_bytes_per_s", "link_latency_s"}


def test_measure_times_forward_and_backward_per_op_and_leaves_the_model_alone():
    zm = zoo.build("resnet", batch=2)  # BatchNorm buffers and in-place residual adds
    g = partitioner.trace(zm.model, zm.args, zm.kwargs)
    for p in zm.model.parameters():
        p.grad = torch.full_like(p, 3.0)
    state = {k: v.clone() for k, v in zm.model.state_dict().items()}
    c = partitioner.measure(g, zm.args, zm.kwargs, repeats=1)
    assert c.measured
    ops = np.array([k != "output" for k in g.kinds])
    assert np.all(c.forward_s[ops] > 0) and np.all(c.forward_s >= 0)
    assert np.all(c.backward_s[c.needs_grad & ops] >= 0) and c.backward_s.sum() > 0
    assert np.all(c.backward_s[~c.needs_grad] == 0)
    convs = [i for i, k in enumerate(g.kinds) if k == "aten.conv2d"]
    assert all(c.backward_s[i] > 0 for i in convs)
    after = zm.model.state_dict()
    assert all(torch.equal(after[k], state[k]) for k in state), "measure() must restore BatchNorm statistics"
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in zm.model.parameters())
    plan = partitioner.partition(g, 2, measure=True, example_inputs=zm.args)
    assert plan.options["measured"] is True


def test_measure_leaves_the_global_random_streams_alone():
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 4)).train()  # dropout draws
    x = torch.randn(4, 16)
    g = partitioner.trace(model, (x,))
    plan = partitioner.partition(g, 2)
    before = torch.get_rng_state()
    partitioner.measure(g, (x,), repeats=1)
    measure_stages(split(g, plan.assignment, 2), (x,), repeats=1)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_traced_loss_is_priced_measured_and_timed_on_the_last_stage():
    """A cross-entropy over many classes is real work on the last stage: trace(loss_fn=...) counts it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4096))
    x, target = torch.randn(64, 16), torch.randint(4096, (64,))
    plain = partitioner.trace(model, (x,))
    g = partitioner.trace(model, (x,), loss_fn=F.cross_entropy, target=target)
    out = g.kinds.index("output")
    assert plain.flops[out] == 0 and g.flops[out] >= 5 * 64 * 4096 and g.move_bytes[out] >= 64 * 4096 * 4
    rates = partitioner.DeviceRates()
    est, est_plain = estimate(g, rates), estimate(plain, rates)
    assert est.forward_s[out] > 0 and est.backward_s[out] > 0 and est_plain.total_s[out] == 0
    assert np.array_equal(np.delete(est.total_s, out), np.delete(est_plain.total_s, out))
    measured = partitioner.measure(g, (x,), repeats=1)
    assert measured.forward_s[out] > 0 and measured.backward_s[out] > 0
    plan = partitioner.partition(g, 2, rates=rates)
    with_loss = measure_stages(split(g, plan.assignment, 2), (x,), repeats=2)
    without = measure_stages(split(plain, plan.assignment, 2), (x,), repeats=2)
    assert with_loss.forward_s[1] > without.forward_s[1] * 0.9 and len(with_loss.forward_s) == 2
    assert all(p.grad is None for p in model.parameters()), "timing the loss must leave no gradients"


# --- Hugging Face models with their default config (use_cache on: they return a DynamicCache) -----------


def _tiny_hf(name: str):
    """A default-config model of each family at toy sizes (use_cache is left at its default, True)."""
    import transformers as T

    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    lm = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
    seq2seq = dict(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)
    torch.manual_seed(0)
    if name == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**lm)), {"input_ids": ids, "labels": ids}
    if name == "mistral":
        return T.MistralForCausalLM(T.MistralConfig(**lm)), {"input_ids": ids, "labels": ids}
    if name == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**lm)), {"input_ids": ids, "labels": ids}
    if name == "t5":
        config = T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                            decoder_start_token_id=0)
        return T.T5ForConditionalGeneration(config), {"input_ids": ids, "labels": ids}
    if name == "bart":
        return T.BartForConditionalGeneration(T.BartConfig(**seq2seq, max_position_embeddings=64)), \
            {"input_ids": ids, "labels": ids}
    config = T.WhisperConfig(**seq2seq, num_mel_bins=8, max_source_positions=16, max_target_positions=16,
                             decoder_start_token_id=1, pad_token_id=0)
    return T.WhisperForConditionalGeneration(config), {"input_features": torch.randn(2, 8, 32), "labels": ids}


def test_default_config_llama_traces_partitions_and_trains_exactly():
    model, kwargs = _tiny_hf("llama")
    assert model.config.use_cache is True
    g = partitioner.trace(model, (), kwargs)
    assert model.config.use_cache is True  # turned off for the trace only
    staged = partitioner.partition(g, 2).as_module()
    want = model(**kwargs).loss
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = staged(**kwargs)["loss"]
    got.backward()
    assert torch.allclose(got, want, rtol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want_grads[n], rtol=1e-4, atol=1e-6), n


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral", "qwen2", "t5", "bart", "whisper"])
def test_default_config_generative_models_trace(name):
    model, kwargs = _tiny_hf(name)
    model.eval()  # BART has dropout by default: compare deterministic runs
    assert model.config.use_cache is True
    g = partitioner.trace(model, (), kwargs)
    out = partitioner.partition(g, 2).as_module()(**kwargs)
    assert torch.allclose(out["loss"], model(**kwargs).loss, rtol=1e-5)
    assert model.config.use_cache is True


def test_tensors_kept_as_plain_attributes_are_shared_not_copied():
    """A model that keeps its last activation (not a graph leaf: deepcopy refuses it) and a constant mask as
    plain attributes traces after a training forward, reads the mask's real values, and copies neither."""

    class KeepsHidden(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4)
            self.mask = torch.arange(16.0) % 2  # a constant, not a buffer
            self.hidden: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.a(x)) * self.mask
            self.hidden = h  # kept for a later look, as torch.distributed.pipelining's MultiMLPWithDw does
            return self.b(h)

    torch.manual_seed(0)
    model, x = KeepsHidden(), torch.randn(8, 16)
    model(x).sum().backward()  # a training forward: model.hidden now carries autograd history
    assert model.hidden is not None and model.hidden.grad_fn is not None
    mask_storage = model.mask.untyped_storage().data_ptr()
    graph = partitioner.trace(model, (x,))
    plan = partitioner.partition(graph, 2)
    torch.testing.assert_close(plan.as_module()(x), model(x), rtol=0, atol=0)
    assert model.mask.untyped_storage().data_ptr() == mask_storage
    constants = [v for m in graph.fx.module.modules() for v in vars(m).values()
                 if isinstance(v, torch.Tensor) and torch.equal(v, model.mask)]  # what the traced program reads
    assert constants and all(v.untyped_storage().data_ptr() == mask_storage for v in constants), \
        "the traced program reads a copy of the mask"


def test_a_custom_autograd_function_is_named_in_a_warning():
    """Its own backward is not what the stages run (torch.export records its forward's ops): say so, by name."""

    class ScaleGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * 1e-6

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(ScaleGrad.apply(self.a(x)))

    apply = torch.autograd.Function.__dict__["apply"]
    with pytest.warns(partitioner.capture.tracing.CustomGradientWarning, match=r"Net applies .*ScaleGrad'\]"):
        partitioner.trace(Net(), (torch.randn(2, 4),))
    with warnings.catch_warnings():
        warnings.simplefilter("error", partitioner.capture.tracing.CustomGradientWarning)
        partitioner.trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),))
    assert torch.autograd.Function.__dict__["apply"] is apply  # tracing put autograd back as it was
