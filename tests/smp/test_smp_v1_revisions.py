"""Every published revision of SageMaker's public SMP v1 scripts (GPT-2, BERT, MNIST) runs on smp with its import
lines unchanged: reductions of each revision (tests/smp/smp_v1_reductions, registry in tests/smp/smp_v1_public.py)
through ``smp launch --as-smdistributed``, with their notebooks' settings on two ranks, and their stop/resume paths."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=120)


def test_the_alias_has_smps_test_helpers_by_name() -> None:
    """The BERT script's ``from smdistributed.modelparallel.test.torch.utils import dump_model, verify`` imports;
    calling one says what it was."""
    done = _python("""
        import smp
        smp.alias_smdistributed()
        from smdistributed.modelparallel.test.torch.utils import dump_model, verify
        try:
            verify()
        except NotImplementedError as exc:
            print(exc)
    """)
    assert done.returncode == 0, done.stderr
    assert "verify was one of SMP's internal test helpers" in done.stdout


def test_model_module_module_reaches_the_model_as_the_2022_gpt2_script_does() -> None:
    """``model.module.module.transformer.h`` (2022-01/05 GPT-2), through an ``FP16_Module``-style wrapper too
    (``model.module.module.module``), and ``model.get_module()`` (2022-10 on): one model, the same objects."""
    done = _python("""
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
        import smp

        class Wrapper(torch.nn.Module):  # the script's FP16_Module: its own submodule named "module"
            def __init__(self, module):
                super().__init__()
                self.add_module("module", module)

            def forward(self, *args, **kwargs):
                return self.module(*args, **kwargs)

        smp.init({"pipeline_parallel_degree": 1, "fp16": True})
        hf = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                        bos_token_id=0, eos_token_id=0, use_cache=False)).half()
        model = smp.DistributedModel(Wrapper(hf))
        wrapper = model.get_module()
        print(isinstance(model.module, Wrapper), model.module.module.module is hf,
              model.module.module.transformer.h is hf.transformer.h, wrapper.module is hf,
              {p.dtype for p in model.parameters()}, sorted(n for n, _ in model.module.named_parameters())[:1])
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "True True True True {torch.float32} ['module.transformer.h.0.attn.c_attn.bias']"), done.stdout


def test_the_fp16_loss_scale_is_in_optimizer_checkpoints() -> None:
    """A resumed fp16 run continues with the saved loss scale, as SMP's fp16 optimizer saved it: the 2022-10 GPT-2
    script at its notebook's fp16 skips its first steps for overflows, and a resume that restarted at 2**32 would
    skip them again."""
    done = _python("""
        import torch
        import smp

        smp.init({"pipeline_parallel_degree": 1, "fp16": True})
        model = smp.DistributedModel(torch.nn.Linear(4, 2))
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=None,
                                             dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0 ** 20})

        @smp.step
        def train_step(model, x):
            loss = model(x).float().pow(2).mean() * 1e30  # overflows at any scale above 1
            model.backward(loss)
            return loss

        train_step(model, torch.ones(2, 4))
        optimizer.step()
        saved = optimizer.local_state_dict()
        fresh = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=None,
                                         dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0 ** 20})
        before = fresh.loss_scaler.get_scale()
        fresh.load_state_dict(saved)
        print(optimizer.overflow, before, saved["_smp_loss_scaler"]["scale"], fresh.loss_scaler.get_scale())
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "1048576.0", "524288.0", "524288.0"], done.stdout


def _full_state_into_delayed_model(rank: int, world: int) -> bool:
    import torch

    import smp

    smp.init({"pipeline_parallel_degree": 1, "ddp": True, "sharded_data_parallel_degree": 2,
              "sdp_param_persistence_threshold": 1, "delayed_parameter_initialization": True})
    torch.manual_seed(0)
    pretrained = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with smp.model_creation():
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model = smp.DistributedModel(net)
    model.load_state_dict(pretrained.state_dict())

    @smp.step
    def forward(model, x):
        return model(x)

    x = torch.ones(2, 4)
    with torch.no_grad():
        return torch.equal(forward(model, x).concat(), pretrained(x))


def test_a_full_state_dict_loads_into_a_model_built_without_weights() -> None:
    """The 2023 GPT-2 script's fine-tuning path: a model built under delayed initialisation with sharded data
    parallelism takes a full state dict (``resume_from_checkpoint(..., tag="fullmodel.pt", partial=False)``) before
    the first step; it was copied into the meta tensors, and the model trained from random weights."""
    from smp.testing import run_ranks

    assert run_ranks(_full_state_into_delayed_model, 2, timeout=120) == [True, True]


def _grad_norm_under_sdp(rank: int, world: int) -> tuple[float, float]:
    import torch
    import torch.nn.functional as F

    import smp

    smp.init({"pipeline_parallel_degree": 1, "ddp": True, "sharded_data_parallel_degree": 2,
              "sdp_param_persistence_threshold": 1, "sdp_gradient_clipping": 0.5})
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    reference.load_state_dict(net.state_dict())
    model = smp.DistributedModel(net)
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 0, 1])

    @smp.step
    def train_step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        model.backward(loss)
        return loss

    train_step(model, x.chunk(2)[rank], y.chunk(2)[rank])
    optimizer.step()
    F.cross_entropy(reference(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
    return float(optimizer._global_grad_norm), float(want)


def test_the_global_gradient_norm_under_sharded_data_parallelism_is_kept_as_smp_kept_it() -> None:
    """``optimizer._global_grad_norm``, which the 2023 GPT-2 script logs under sharded data parallelism: the norm
    of the whole model's gradient before ``sdp_gradient_clipping``."""
    from smp.testing import run_ranks

    for got, want in run_ranks(_grad_norm_under_sdp, 2, timeout=120):
        assert abs(got - want) < 1e-5 * want, (got, want)


def test_an_optimizer_object_that_is_not_a_torch_optimizer_is_returned_with_smps_state_dict_methods() -> None:
    """The 2022 GPT-2 script's ``smp.DistributedOptimizer(FP16_Optimizer(...))``: the wrapper's own ``step``,
    ``zero_grad(set_grads_to_None=)``, ``overflow`` and attributes, SMP's ``local_state_dict``; refused under smp's
    own ``fp16``, which scales the loss in a DistributedOptimizer of a torch optimizer."""
    done = _python("""
        import torch
        import smp

        class Wrapper:  # the shape of Megatron's FP16_Optimizer
            def __init__(self, optimizer):
                self.optimizer, self.overflow, self.steps = optimizer, False, 0

            @property
            def param_groups(self):
                return self.optimizer.param_groups

            def zero_grad(self, set_grads_to_None=False):
                self.optimizer.zero_grad(set_to_none=set_grads_to_None)

            def step(self):
                self.steps += 1
                return self.optimizer.step()

            def state_dict(self):
                return self.optimizer.state_dict()

            def load_state_dict(self, sd):
                self.optimizer.load_state_dict(sd)

        smp.init({"pipeline_parallel_degree": 1})
        model = smp.DistributedModel(torch.nn.Linear(2, 1))
        wrapper = Wrapper(torch.optim.Adam(model.parameters()))
        optimizer = smp.DistributedOptimizer(wrapper)
        optimizer.zero_grad(set_grads_to_None=True)
        optimizer.overflow = True  # the script sets the loss scaler and flags this way when it resumes
        optimizer.step()
        print(isinstance(optimizer, Wrapper), wrapper.overflow, wrapper.steps, optimizer.steps,
              sorted(optimizer.local_state_dict()), optimizer.state_dict()["param_groups"][0]["lr"])
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\\n")[0].split() == ["True", "True", "1", "1", "['param_groups',", "'state']", "0.001"]
    refused = _python("""
        import torch
        import smp

        class Wrapper:
            def __init__(self, optimizer):
                self.optimizer = optimizer
                self.param_groups = optimizer.param_groups

            def step(self):
                pass

        smp.init({"pipeline_parallel_degree": 1, "fp16": True})
        model = smp.DistributedModel(torch.nn.Linear(2, 1))
        smp.DistributedOptimizer(Wrapper(torch.optim.Adam(model.parameters())))
    """)
    assert "ForeignOptimizerError: smp.DistributedOptimizer(Wrapper): with 'fp16' or 'bf16'" in refused.stderr


def _tp_surface(rank: int, world: int) -> dict:
    import torch
    import transformers as T

    import smp

    smp.init({"pipeline_parallel_degree": 1, "ddp": True, "tensor_parallel_degree": 2})
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        net = T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                                             use_cache=False, bos_token_id=0, eos_token_id=0))
    model = smp.DistributedModel(net)

    @smp.step
    def forward(model, ids):
        return model(input_ids=ids)["logits"]

    with torch.no_grad():
        forward(model, torch.randint(64, (2, 8), generator=torch.Generator().manual_seed(0)))
    layer = model.get_module().transformer.seq_layers[0]
    ran = []
    model.register_post_partition_hook(lambda m, opt: ran.append("now"))  # partitioned: runs at once
    return {"query": (model.is_distributed_parameter(layer.attention.query.weight),
                      smp.utils.get_distribution_axis(layer.attention.query.weight)),
            "norm": (model.is_distributed_parameter(layer.attention.pre_layernorm.weight),
                     smp.utils.get_distribution_axis(layer.attention.pre_layernorm.weight)), "hook": ran}


def test_tensor_parallel_parameters_say_they_are_split_and_along_which_axis() -> None:
    """``model.is_distributed_parameter`` (SMP's) and ``smp.utils.get_distribution_axis``, which the 2022 GPT-2
    script's fp16 optimizer notes for each master weight; a post-partition hook registered after partitioning runs
    at once (the script registers the one that loads its optimizer state inside a post-step hook)."""
    from smp.testing import run_ranks

    for r in run_ranks(_tp_surface, 2, timeout=180):
        assert r == {"query": (True, 0), "norm": (False, None), "hook": ["now"]}, r
