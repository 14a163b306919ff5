"""Context parallelism through the SMP surface (``context_parallel_degree``): on spawned gloo ranks, every sequence of
the batch a cp group shares is split over its ranks (attention gathering the group's keys and values), and training
matches one process on that batch: losses, every gradient and the parameters after the optimizer's steps, for Llama,
Qwen2 and GPT-2 at two sequence lengths, under a pipeline (slow); and the configurations it refuses say why."""
from __future__ import annotations

import copy

import pytest
import torch

from smp.testing import run_ranks

CP2 = {"pipeline_parallel_degree": 1, "ddp": True, "microbatches": 2, "context_parallel_degree": 2}


def causal_lm(kind: str) -> torch.nn.Module:
    """A small ``transformers`` causal LM with random weights (seed 0): "llama", "qwen2" or "gpt2"."""
    import transformers as T

    torch.manual_seed(0)
    if kind == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    return T.Qwen2ForCausalLM(T.Qwen2Config(**shape)) if kind == "qwen2" else T.LlamaForCausalLM(T.LlamaConfig(**shape))


def _batch(step: int, seq: int) -> torch.Tensor:
    return torch.randint(0, 128, (4, seq), generator=torch.Generator().manual_seed(100 + step))


def _train(rank: int, world: int, config: dict, kind: str, seq: int, steps: int) -> dict:
    import smp

    smp.init(config)
    net = causal_lm(kind)
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    @smp.step
    def train_step(model, ids, labels):
        out = model(ids, labels=labels)
        model.backward(out.loss)
        return out.loss

    worst: dict = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    cp = config["context_parallel_degree"]
    for k in range(steps):
        ids = _batch(k, seq)
        labels = ids.clone()
        labels[:, :3] = -100  # ignored targets: the mean is over the group's kept ones, not each rank's
        d, n = smp.dp_rank(), smp.dp_size()
        loss = train_step(model, ids.chunk(n)[d], labels.chunk(n)[d])
        # one process on the cp group's batch (its ranks' batches in cp_rank order), microbatch by microbatch
        m, group = config["microbatches"], d // cp
        mine = [torch.cat(part.chunk(n)[group * cp:(group + 1) * cp]) for part in (ids, labels)]
        outs = [reference(i, labels=t) for i, t in zip(mine[0].chunk(m), mine[1].chunk(m))]
        groups = [[torch.cat(part.chunk(n)[g * cp:(g + 1) * cp]) for part in (ids, labels)] for g in range(n // cp)]
        ref_loss = sum(reference(i, labels=t).loss for g in groups for i, t in zip(g[0].chunk(m), g[1].chunk(m)))
        (ref_loss / (m * len(groups))).backward()
        worst["loss"] = max(worst["loss"], abs(float(loss.reduce_mean()) - sum(float(o.loss) for o in outs) / m))
        for name, p in model.local_named_parameters():
            off = float((p.grad - reference.get_parameter(name).grad).abs().max())
            if off > worst["grad"]:
                worst["grad"], worst["grad_of"] = off, name
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    for name, p in model.local_named_parameters():
        worst["param"] = max(worst["param"], float((p.detach() - reference.get_parameter(name).detach()).abs().max()))
    context = model.partition_plan().traced_graph().fx.context  # what the ranks ran: each on its half of the tokens
    worst["context"] = (context.cp, context.sequence, context.attentions, context.notes)
    return worst


@pytest.mark.parametrize("kind,seq", [("llama", 16), ("llama", 24), ("gpt2", 16),
                                      pytest.param("qwen2", 32, marks=pytest.mark.slow),
                                      pytest.param("gpt2", 24, marks=pytest.mark.slow)])
def test_cp2_trains_as_one_process(kind, seq):
    for w in run_ranks(_train, 2, CP2, kind, seq, 2, timeout=240):
        assert w["context"] == (2, seq, 2, ()), w  # both attentions gathered keys and values, nothing else whole
        assert w["loss"] < 1e-5, w
        assert w["grad"] < 1e-5 and w["param"] < 1e-4, w


@pytest.mark.slow
def test_pp2_cp2_trains_as_one_process():
    config = {**CP2, "pipeline_parallel_degree": 2, "microbatches": 4}
    for w in run_ranks(_train, 4, config, "llama", 16, 2, timeout=400):
        assert w["context"] == (2, 16, 2, ()), w
        assert w["loss"] < 1e-5 and w["grad"] < 1e-5 and w["param"] < 1e-4, w
