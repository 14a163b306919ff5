"""SMP v1's tensor-parallel surface: what ``smp.tensor_parallelism``, ``set_tensor_parallelism`` and
``model_creation`` mark, what ``smp.DistributedModel`` substitutes (the outermost supported module, with the
original's weights and SMP's module structure), what tensor parallelism may then split, and the errors."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import smp
from smp.nn import DistributedTransformer, DistributedTransformerLMHead
from smp.runtime import state
from smp.runtime.compat import NoEffectWarning
from smp.runtime.config import ConfigError, load_config
from smp.runtime.topology import Topology
from smp.tensor_parallel import distribute
from smp.testing import run_ranks
from tests.smp.features import shard_grad_error
from tests.smp.test_tp_training import VOCAB, build


@pytest.fixture
def initialised(monkeypatch):
    st = state.State(config=load_config({"partitions": 1}), topology=Topology(1, 1, placement="cluster"), rank=0,
                     mp_group=None, dp_group=None, device=torch.device("cpu"))
    monkeypatch.setattr(state, "_state", st)
    return st


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ["gpt2", "gptj", "gptneo", "bert"])
def test_a_supported_model_becomes_smps_module_with_the_same_function(initialised, kind):
    reference = build(kind).eval()
    with smp.tensor_parallelism():
        model = build(kind).eval()
    new, shardable = distribute(model)
    if kind == "bert":  # the encoder is replaced in place; the rest of the model keeps its modules and names
        assert new is model and isinstance(model.bert.encoder, DistributedTransformer)
        assert "bert.encoder.seq_layers.0.attention.query.weight" in shardable
        assert "bert.embeddings.word_embeddings.weight" in shardable  # an enabled nn.Embedding: SMP's distributed one
    else:  # the whole causal LM is replaced; SMP's path to the layers is there
        assert isinstance(new, DistributedTransformerLMHead) and len(new.transformer.seq_layers) == 2
        assert new.transformer.seq_layers[0].attention.query.weight.shape == (64, 64)
        assert "word_embedding.weight" not in shardable  # distribute_embedding=False, SMP's default
    ids = _ids()
    want, got = reference(input_ids=ids, labels=ids), new(input_ids=ids, labels=ids)
    assert type(got) is type(want)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
    assert initialised.translate_functions  # recorded for checkpoints (smp.state.module_manager)


def test_only_the_outermost_supported_module_is_distributed_and_the_innermost_context_wins(initialised):
    import transformers as T
    cfg = T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16)
    with smp.tensor_parallelism():
        outer = T.GPT2LMHeadModel(cfg)  # GPT2LMHeadModel is supported: its blocks are not substituted apart
        with smp.tensor_parallelism(enabled=False):
            body = T.GPT2Model(cfg)  # created disabled: stays, and so do its blocks
        head = nn.Linear(32, 8)
    wrapper = nn.ModuleDict({"lm": outer, "body": body, "head": head})
    new, shardable = distribute(wrapper)
    assert isinstance(new["lm"], DistributedTransformerLMHead) and type(new["body"]) is T.GPT2Model
    assert {"head.weight", "head.bias"} <= shardable  # an enabled nn.Linear is SMP's DistributedLinear
    assert not any(n.startswith("body.") for n in shardable)


def test_set_tensor_parallelism_marks_a_built_model_and_its_blocks(initialised):
    import transformers as T
    model = T.GPT2Model(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).eval()
    ids = _ids()
    want = model(ids).last_hidden_state
    smp.set_tensor_parallelism(model, True)
    smp.set_tensor_parallelism(model.h[1], False)
    new, shardable = distribute(model)
    assert type(new.h[0]).__name__ == "DistributedTransformerLayer" and type(new.h[1]).__name__ == "GPT2Block"
    assert "h.0.attention.query.weight" in shardable and "h.1.attn.c_attn.weight" not in shardable
    torch.testing.assert_close(new(ids).last_hidden_state, want, rtol=1e-5, atol=1e-5)


def test_a_model_transformers_did_not_initialise_gets_smps_initialisation(initialised, monkeypatch):
    from transformers.modeling_utils import PreTrainedModel
    monkeypatch.setattr(PreTrainedModel, "init_weights", lambda self: None)  # SMP's published start-up shortcut
    with smp.tensor_parallelism():
        model = build("gpt2")
    assert model.lm_head.weight is not model.transformer.wte.weight  # neither initialised nor tied
    state = torch.get_rng_state()
    new, _ = distribute(model)
    assert torch.equal(state, torch.get_rng_state())  # drawn from a forked stream
    assert new.lm_head.weight is new.word_embedding.weight  # tied, as the config says
    assert abs(float(new.word_embedding.weight.std()) - 0.02) < 0.005  # SMP's normal(0, initializer_range)
    with smp.tensor_parallelism():
        again, _ = distribute(build("gpt2"))
    assert torch.equal(again.word_embedding.weight, new.word_embedding.weight)  # from the shared seed


def test_nothing_marked_leaves_the_model_and_lets_everything_split(initialised):
    model = build("llama")
    assert distribute(model) == (model, None)


def test_keywords_reach_the_distributed_module_or_warn(initialised):
    with smp.tensor_parallelism(fused_bias_gelu=True, distribute_embedding=True):
        model = build("gpt2")
    new, shardable = distribute(model)
    assert new.config.fused_bias_gelu and "word_embedding.weight" in shardable
    with smp.tensor_parallelism(unheard_of=1):
        model = build("gpt2")
    with pytest.warns(NoEffectWarning, match=r"unheard_of=\.\.\."):
        distribute(model)
    with smp.tensor_parallelism(fused_softmax=True):
        model = build("gpt2")
    with pytest.warns(NoEffectWarning, match="fused_softmax"):  # SMP's CUDA kernel; the numbers are the same here
        distribute(model)


def test_model_creation_marks_and_delays(initialised, monkeypatch):
    monkeypatch.setattr(initialised, "config", load_config({"partitions": 1, "delayed_parameter_initialization": True}))
    with smp.model_creation(tensor_parallelism=True, dtype=torch.float64):
        model = build("gpt2")
    assert torch.get_default_dtype() == torch.float32
    assert all(p.is_meta and p.dtype == torch.float64 for p in model.parameters())
    new, _ = distribute(model)
    assert isinstance(new, DistributedTransformerLMHead)
    assert all(p.is_meta and p.dtype == torch.float64 for p in new.parameters())


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return self.fc(x)


class DistBlock(smp.nn.DistributedModule):
    def __init__(self, hidden: int):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, pair):
        return self.proj(pair[0]) * pair[1]


def test_a_registered_module_is_replaced_through_its_hooks(initialised):
    smp.tp_register_with_module(Block, DistBlock, init_hook=lambda width: ((), {"hidden": width}),
                                forward_hook=lambda x: (((x, 2.0),), {}), return_hook=lambda y: y + 1)
    with smp.tensor_parallelism():
        model = nn.Sequential(Block(4))
    new, shardable = distribute(model)
    assert isinstance(new[0], DistBlock) and shardable == {"0.proj.weight", "0.proj.bias"}
    x = torch.ones(1, 4)
    torch.testing.assert_close(new(x), new[0].proj(x) * 2.0 + 1)
    with pytest.raises(TypeError, match="subclass of smp.nn.DistributedModule"):
        smp.tp_register(nn.Linear)


def test_misuse(initialised, monkeypatch):
    with pytest.raises(TypeError, match="enabled must be True or False"):
        with smp.tensor_parallelism(enabled="yes"):
            pass
    with pytest.raises(ConfigError, match="ddp"):  # as in SMP v1, tensor parallelism is carved out of ddp ranks
        load_config({"partitions": 1, "tensor_parallel_degree": 2})
    initialised.model = object()
    with pytest.raises(RuntimeError, match="before smp.DistributedModel"):
        smp.set_tensor_parallelism(nn.Linear(2, 2))
    monkeypatch.setattr(state, "_state", None)
    with pytest.raises(RuntimeError, match="call smp.init"):
        with smp.tensor_parallelism():
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nn.Linear(2, 2)  # the marking hook is gone after the context
    assert torch.nn.Module.__init__.__name__ == "__init__"


def _substituted_run(rank: int, world: int, kind: str, pp: int) -> dict:
    from smp.tp_registry import substitution_for
    tp, m = world // pp, 2
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    ref = build(kind)
    want = sum(ref(input_ids=ids[i:i + 2], labels=ids[i:i + 2]).loss for i in (0, 2)) / m
    want.backward()
    translate = substitution_for(ref.bert.encoder if kind == "bert" else ref).translate[1]
    grads = translate({n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)})
    smp.init({"pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "ddp": True, "microbatches": m})
    with smp.tensor_parallelism():
        built = build(kind)
    model = smp.DistributedModel(built)

    @smp.step
    def train_step(model, x):
        loss = model(input_ids=x, labels=x).loss
        model.backward(loss)
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = train_step(model, ids).reduce_mean()
    worst, split = shard_grad_error(model, grads)
    layer = model.get_module().transformer.seq_layers[0] if kind != "bert" else None
    return {"loss": float(loss), "want": float(want), "worst": worst, "split": split,
            "query": tuple(layer.attention.query.weight.shape) if layer is not None else None}


def test_smp_gpt2_substituted_under_tp2_trains_exactly_on_its_shards():
    for r in run_ranks(_substituted_run, 2, "gpt2", 1, timeout=240):
        assert abs(r["loss"] - r["want"]) < 1e-5 and r["worst"] < 1e-5, r
        assert r["query"] == (32, 64) and r["split"] > 0  # SMP's module path, holding this rank's half


@pytest.mark.slow
@pytest.mark.parametrize("kind,pp", [("bert", 1), ("gptj", 1), ("gpt2", 2)])
def test_smp_substituted_models_on_more_layouts(kind, pp):
    for r in run_ranks(_substituted_run, 2 * pp, kind, pp, timeout=400):
        assert abs(r["loss"] - r["want"]) < 1e-5 and r["worst"] < 1e-5, r
