"""Context parallelism through the SMP surface (``context_parallel_degree``): on spawned gloo ranks, every sequence of
the batch a cp group shares is split over its ranks (attention gathering the group's keys and values), and training
matches one process on that batch: losses, every gradient and the parameters after the optimizer's steps, for Llama,
Qwen2 and GPT-2 at two sequence lengths, under a pipeline (slow); and the configurations it refuses say why."""
from __future__ import annotations

import copy

import pytest
import torch

from smp.testing import run_ranks
from tests.smp.features import advance, lm_run, refusal, shifted, with_reference

CP2 = {"pipeline_parallel_degree": 1, "ddp": True, "microbatches": 2, "context_parallel_degree": 2}


def causal_lm(kind: str) -> torch.nn.Module:
    """A small ``transformers`` language model with random weights (seed 0): "llama", "qwen2", "gpt2", "gpt2_eager"
    (attention spelt out as matmuls and a softmax) or "t5" (an encoder-decoder)."""
    import transformers as T

    torch.manual_seed(0)
    if kind == "t5":
        return T.T5ForConditionalGeneration(T.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                                       num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                                       pad_token_id=0))
    if kind.startswith("gpt2"):
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                              attn_implementation="eager" if kind == "gpt2_eager" else "sdpa"))
    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    return T.Qwen2ForCausalLM(T.Qwen2Config(**shape)) if kind == "qwen2" else T.LlamaForCausalLM(T.LlamaConfig(**shape))


def _batch(step: int, seq: int, rows: int = 4) -> torch.Tensor:
    return torch.randint(0, 128, (rows, seq), generator=torch.Generator().manual_seed(100 + step))


def _train(rank: int, world: int, config: dict, kind: str, seq: int, steps: int) -> dict:
    import smp

    model, opt, reference, ref_opt = with_reference(config, causal_lm(kind))

    @smp.step
    def train_step(model, ids, labels):
        out = model(ids, labels=labels)
        model.backward(out.loss)
        return out.loss

    worst: dict = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    # The ranks that run one batch: a cp group of consecutive replicas, of tp groups (which fill dp_rank's order).
    group = config["context_parallel_degree"] * config.get("tensor_parallel_degree", 1)
    for k in range(steps):
        ids = _batch(k, seq, 2 * smp.dp_size())
        labels = ids.clone()
        labels[:, :3] = -100  # ignored targets: the mean is over the group's kept ones, not each rank's
        d, n = smp.dp_rank(), smp.dp_size()
        loss = train_step(model, ids.chunk(n)[d], labels.chunk(n)[d])
        # one process on each group's batch; every microbatch keeps as many targets, so the mean of their means is
        # the batch's mean, whatever order the group's rows are in
        batches = [[torch.cat(part.chunk(n)[g * group:(g + 1) * group]) for part in (ids, labels)]
                   for g in range(n // group)]
        outs = [reference(i, labels=t).loss for i, t in batches]
        (sum(outs) / len(outs)).backward()
        worst["loss"] = max(worst["loss"], abs(float(loss.reduce_mean()) - float(outs[d // group])))
        for name, p in model.local_named_parameters():
            off = float((p.grad - _mine(model, name, reference.get_parameter(name).grad)).abs().max())
            if off > worst["grad"]:
                worst["grad"], worst["grad_of"] = off, name
        advance(opt, ref_opt)
    for name, p in model.local_named_parameters():
        worst["param"] = max(worst["param"], float((p.detach() - _mine(model, name, reference.get_parameter(name))
                                                    ).abs().max()))
    context = model.partition_plan().traced_graph().fx.context  # what the ranks ran: each on its half of the tokens
    worst["context"] = (context.cp, context.sequence, context.attentions, context.notes)
    return worst


def _mine(model, name: str, whole: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a whole tensor of the reference: its tp shard (all of it without tensor parallelism)."""
    import smp
    from partitioner.capture.program import tensor_aliases
    from partitioner.tp.shard_program import shard_tensor

    fx = model.partition_plan().traced_graph().fx
    if fx.sharding is None:
        return whole.detach()
    alias = tensor_aliases(fx.module)
    shards = {alias.get(t, t): s for t, s in fx.sharding.params.items()}
    spec = shards.get(alias.get(name, name))
    return whole.detach() if spec is None else shard_tensor(whole.detach(), spec, smp.tp_size(), smp.tp_rank())


@pytest.mark.parametrize("kind,seq", [("llama", 16), pytest.param("llama", 24, marks=pytest.mark.slow), ("gpt2", 16),
                                      pytest.param("qwen2", 32, marks=pytest.mark.slow),
                                      pytest.param("gpt2", 24, marks=pytest.mark.slow),
                                      pytest.param("gpt2_eager", 24, marks=pytest.mark.slow),
                                      pytest.param("t5", 16, marks=pytest.mark.slow)])
def test_cp2_trains_as_one_process(kind, seq):
    for w in run_ranks(_train, 2, CP2, kind, seq, 2, timeout=240):
        # both attentions gathered keys and values, nothing else whole; T5's decoder (its ids made from the labels)
        # runs whole, its cross-attentions gathering the encoder's sequence
        notes = 2 if kind == "t5" else 0
        assert w["context"][:3] == (2, seq, 2) and len(w["context"][3]) == notes, w
        assert w["loss"] < 1e-5, w
        assert w["grad"] < 1e-5 and w["param"] < 1e-4, w


@pytest.mark.slow
def test_pp2_cp2_trains_as_one_process():
    config = {**CP2, "pipeline_parallel_degree": 2, "microbatches": 2}
    for w in run_ranks(_train, 4, config, "llama", 16, 2, timeout=400):
        assert w["context"] == (2, 16, 2, ()), w
        assert w["loss"] < 1e-5 and w["grad"] < 1e-5 and w["param"] < 1e-4, w


@pytest.mark.slow
def test_tp2_cp2_trains_as_one_process():
    config = {**CP2, "tensor_parallel_degree": 2}
    for w in run_ranks(_train, 4, config, "llama", 16, 2, timeout=400):
        assert w["context"] == (2, 16, 2, ()), w  # tensor parallelism's ops on each rank's tokens too
        assert w["loss"] < 1e-5 and w["grad"] < 1e-5 and w["param"] < 1e-4, w


def _checkpoints(rank: int, world: int) -> dict:
    """Two AdamW steps under cp 2 with a full checkpoint after the first; fresh models of other weights load it under
    cp 2 and under plain data parallelism (cp 1: each rank its own rows, the same mean here, every row keeping as many
    targets) and take the second step, which must end where the run that never stopped did; then a batch of another
    sequence length, which context parallelism does not trace again, is refused with the reason."""
    import smp

    def run(config: dict, steps: range, load: tuple | None = None) -> tuple:
        net = causal_lm("llama") if load is None else shifted(causal_lm("llama"))
        model, _, step, kept = lm_run(config, net, steps, lambda k: _batch(k, 16).chunk(smp.dp_size())[smp.dp_rank()],
                                      load, lambda model, opt: (model.state_dict(), opt.state_dict()))
        return model, step, kept

    model, _, saved = run(CP2, range(2))
    straight = model.state_dict()
    out = {}
    for cp in (1, 2):
        # a copy each: torch's optimizer loads state tensors without copying them, and its steps update them
        model, step, _ = run({**CP2, "context_parallel_degree": cp}, range(1, 2), copy.deepcopy(saved))
        out[f"cp{cp}"] = max(float((model.state_dict()[k] - v).abs().max()) for k, v in straight.items())
    out["refused"] = refusal(step, model, _batch(0, 24).chunk(2)[smp.dp_rank()])
    return out


@pytest.mark.slow
def test_a_checkpoint_saved_under_cp2_resumes_under_cp2_and_cp1_and_other_lengths_are_refused():
    for out in run_ranks(_checkpoints, 2, timeout=300):
        assert out["cp2"] < 1e-6 and out["cp1"] < 1e-5, out
        assert "context parallelism (degree 2)" in out["refused"], out["refused"]
