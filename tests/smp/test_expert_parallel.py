"""Expert parallelism through the SMP surface (``expert_parallel_degree``): on spawned gloo ranks, each data-parallel
rank holds ``experts / ep`` of every layer's experts (and their optimizer state), tokens reach their experts by
all-to-all, and training matches one process: losses, auxiliary load-balancing losses, every gradient and the
parameters after the optimizer's steps, for Mixtral, a DeepSeek-V3-style model (shared experts, grouped sigmoid
routing, a dense first layer) and gpt-oss (a bias per expert), under a pipeline (slow), and checkpoints across
degrees."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from smp.testing import run_ranks
from tests.smp.features import advance, lm_run, refusal, shifted, with_reference

EP2 = {"pipeline_parallel_degree": 1, "ddp": True, "microbatches": 2, "expert_parallel_degree": 2}


def moe_model(kind: str) -> torch.nn.Module:
    """A small ``transformers`` mixture of experts with random weights (seed 0): "mixtral", "deepseek_v3" or
    "gpt_oss" (a bias per expert, its own gating)."""
    import transformers as T

    warnings.filterwarnings("ignore", message=".*RoPE scaling factor.*")
    torch.manual_seed(0)
    if kind == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(
            vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
            output_router_logits=True, router_aux_loss_coef=0.02))
    if kind == "gpt_oss":
        return T.GptOssForCausalLM(T.GptOssConfig(
            vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
            layer_types=["full_attention", "full_attention"], output_router_logits=True))
    return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64))


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(100 + step))


def _train(rank: int, world: int, config: dict, kind: str, steps: int) -> dict:
    import smp

    model, opt, reference, ref_opt = with_reference(config, moe_model(kind))

    @smp.step
    def train_step(model, ids):
        out = model(ids, labels=ids)
        model.backward(out.loss)
        return out.loss, out.aux_loss if out.aux_loss is not None else out.loss.detach() * 0

    worst: dict = {"loss": 0.0, "aux": 0.0, "grad": 0.0, "param": 0.0}
    shapes: dict = {}
    for k in range(steps):
        ids = _batch(k)
        d, n = smp.dp_rank(), smp.dp_size()
        loss, aux = train_step(model, ids.chunk(n)[d])
        # one process, microbatch by microbatch (the router's auxiliary loss is not linear in the batch)
        m = config["microbatches"]
        outs = [[reference(mb, labels=mb) for mb in part.chunk(m)] for part in ids.chunk(n)]
        ref_loss = sum(o.loss for part in outs for o in part) / (n * m)
        ref_loss.backward()
        mine = sum(float(o.loss) for o in outs[d]) / m
        worst["loss"] = max(worst["loss"], abs(float(loss.reduce_mean()) - mine))
        if outs[d][0].aux_loss is not None:
            ref_aux = sum(float(o.aux_loss) for o in outs[d]) / m
            worst["aux"] = max(worst["aux"], abs(float(aux.reduce_mean()) - ref_aux))
        spec = model.expert_shards()
        for name, p in model.local_named_parameters():
            want = reference.get_parameter(name).grad
            if name in spec:
                want = want[spec[name][0]:spec[name][1]]
                shapes[name] = (tuple(p.shape), tuple(reference.get_parameter(name).shape))
            off = float((p.grad - want).abs().max())
            if off > worst["grad"]:
                worst["grad"], worst["grad_of"] = off, name
        advance(opt, ref_opt)
    for name, p in model.local_named_parameters():
        want = reference.get_parameter(name).detach()
        if name in spec:
            want = want[spec[name][0]:spec[name][1]]
        worst["param"] = max(worst["param"], float((p.detach() - want).abs().max()))
    state_shapes = {tuple(s["exp_avg"].shape) for p, s in opt.state.items() if s and p.dim() == 3}
    return {"worst": worst, "shapes": shapes, "state_shapes": state_shapes}


@pytest.mark.parametrize("kind", ["mixtral", pytest.param("deepseek_v3", marks=pytest.mark.slow),
                                  pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_ep2_trains_as_one_process_with_half_the_experts_per_rank(kind):
    for out in run_ranks(_train, 2, EP2, kind, 2, timeout=240):
        w = out["worst"]
        assert w["loss"] < 1e-5 and w["aux"] < 1e-5, w
        # an expert's weight gradient sums both ranks' rows in one matmul (another order than one process's), and
        # two AdamW steps at lr 1e-2 carry that rounding into the weights
        assert w["grad"] < 2e-5 and w["param"] < 1e-4, w
        assert out["shapes"], "no expert weight was sharded"
        for mine, whole in out["shapes"].values():
            assert mine[0] * 2 == whole[0] and mine[1:] == whole[1:], (mine, whole)
        assert all(s[0] * 2 in {whole[0] for _, whole in out["shapes"].values()} for s in out["state_shapes"])


@pytest.mark.slow
def test_pp2_ep2_trains_as_one_process():
    config = {**EP2, "pipeline_parallel_degree": 2, "microbatches": 4}
    for out in run_ranks(_train, 4, config, "mixtral", 2, timeout=400):
        w = out["worst"]
        assert w["loss"] < 1e-5 and w["aux"] < 1e-5 and w["grad"] < 2e-5 and w["param"] < 1e-4, w


def _checkpoints(rank: int, world: int, resume_ep: int) -> dict:
    """One AdamW step under ep 2, full and partial state dicts taken, then a second step; a fresh model of other
    weights under ep ``resume_ep`` (1: plain data parallelism) loads the full ones and takes the second step too,
    which must end where the run that never stopped did; the partial ones load back into their own ep rank and are
    refused by the other."""
    import torch.distributed as dist

    import smp

    def run(config: dict, steps: range, load: tuple | None = None) -> tuple:
        net = moe_model("mixtral") if load is None else shifted(moe_model("mixtral"))
        model, opt, _, saved = lm_run(
            config, net, steps, lambda k: _batch(k).chunk(smp.dp_size())[smp.dp_rank()], load,
            lambda model, opt: (model.state_dict(), opt.state_dict(), model.local_state_dict(), opt.local_state_dict()))
        return model, opt, saved

    model, _, (full, opt_full, partial, opt_partial) = run(EP2, range(2))
    straight = model.state_dict()
    out = {"experts_whole": tuple(full["model.layers.0.mlp.experts.gate_up_proj"].shape)}
    model, opt, _ = run({**EP2, "expert_parallel_degree": resume_ep}, range(1, 2), (full, opt_full))
    resumed = model.state_dict()
    out["resumed"] = max(float((resumed[k] - v).abs().max()) for k, v in straight.items())
    if resume_ep != 2:
        return out
    model.load_state_dict(partial)
    opt.load_state_dict(opt_partial)
    out["partial"] = max(float((p.detach() - partial[n]).abs().max()) for n, p in model.local_named_parameters())
    theirs: list = [None, None]
    dist.all_gather_object(theirs, partial, group=dist.group.WORLD)
    out["refused"] = refusal(model.load_state_dict, theirs[1 - rank])
    return out


@pytest.mark.slow
def test_a_full_checkpoint_saved_under_ep2_resumes_under_ep1_exactly():
    for out in run_ranks(_checkpoints, 2, 1, timeout=300):
        assert out["experts_whole"] == (4, 96, 32), out
        assert out["resumed"] < 1e-6, out


@pytest.mark.slow
def test_checkpoints_resume_under_ep2_and_partial_ones_load_into_their_own_ep_rank_only():
    for out in run_ranks(_checkpoints, 2, 2, timeout=300):
        assert out["resumed"] < 1e-6, out
        assert out["partial"] == 0.0, out
        assert "ep rank" in out["refused"] and "expert_parallel_degree=2" in out["refused"], out


def _tp_ep(rank: int, world: int) -> dict:
    """One step of Mixtral under tp 2 x ep 2 (4 ranks, each tp group reading one batch): the loss and the gradients
    of every weight tensor parallelism leaves whole (the experts among them) against one process."""
    import smp

    smp.init({"pipeline_parallel_degree": 1, "ddp": True, "microbatches": 2, "tensor_parallel_degree": 2,
              "expert_parallel_degree": 2, "prescaled_batch": True})
    net = moe_model("mixtral")
    reference = copy.deepcopy(net)
    model = smp.DistributedModel(net)

    @smp.step
    def train_step(model, ids):
        out = model(ids, labels=ids)
        model.backward(out.loss)
        return out.loss

    r, n, m = smp.rdp_rank(), smp.rdp_size(), 2
    loss = float(train_step(model, _batch(0).chunk(n)[r]).reduce_mean())
    outs = [[reference(mb, labels=mb) for mb in part.chunk(m)] for part in _batch(0).chunk(n)]
    (sum(o.loss for part in outs for o in part) / (n * m)).backward()
    spec = model.expert_shards()
    worst, compared = 0.0, 0
    for name, p in model.local_named_parameters():
        want = reference.get_parameter(name).grad
        want = want[spec[name][0]:spec[name][1]] if name in spec else want
        if p.grad.shape == want.shape:  # tp's shards are checked by tests/smp/test_tp_training.py
            worst, compared = max(worst, float((p.grad - want).abs().max())), compared + 1
    return {"loss": abs(loss - sum(float(o.loss) for o in outs[r]) / m), "grad": worst, "experts": len(spec),
            "compared": compared}


@pytest.mark.slow
def test_tp2_ep2_trains_as_one_process():
    for out in run_ranks(_tp_ep, 4, timeout=400):
        assert out["loss"] < 1e-5 and out["grad"] < 2e-5 and out["experts"] == 4 and out["compared"] > 8, out
