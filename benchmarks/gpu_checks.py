"""The six checks of ``benchmarks/gpu_check.py``, one function each: ``check_x(dev) -> Row``.

Every check builds what it needs from :func:`gpt2` (cached per device and precision, so the three checks that use
the model trace and plan it once) and returns a :class:`Row`; a check that cannot run on ``dev`` raises
:class:`Skip`; any other exception is the check's failure, which ``gpu_check.py`` turns into a FAIL row.
"""
from __future__ import annotations

import copy
import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["Row", "Skip", "CHECKS", "gpt2", "BF16_LOSS_RTOL", "BF16_GRAD_RTOL"]

# bf16 keeps 8 significant bits: one rounding is off by at most 2^-8 ~ 0.4 % of the value. The pipelined run splits
# the batch into microbatches, so its matmuls have other shapes, block and accumulate in another order and round
# differently; through 4 layers forward and back those one-ulp differences compound to a few ulps. 1 % on the loss
# and 4 % of each gradient's largest entry (10 ulps) is bf16's noise; a real bug (a lost stage, a missing cast, a
# gradient counted twice) is off by tens of percent or more.
BF16_LOSS_RTOL = 1e-2
BF16_GRAD_RTOL = 4e-2


class Skip(Exception):  # noqa: N818 -- raised to mean SKIP, not an error
    """The check has no meaning on this device; the message says why."""


@dataclass
class Row:
    """One line of the table: ``measured`` beside ``expected``, their ``ratio`` (or error), PASS/FAIL/SKIP."""

    check: str
    device: str
    measured: str
    expected: str
    ratio: str
    status: str


@dataclass
class Model:
    """A tiny GPT-2 (random weights, no dropout: runs are comparable) and its batch on one device."""

    net: Any
    ids: torch.Tensor
    device: torch.device


def _cuda(dev: torch.device) -> None:
    if dev.type != "cuda":
        raise Skip("needs CUDA")


def gpt2(dev: torch.device, big: bool = False, cuda: bool = False) -> Model:
    """A fresh copy of a tiny GPT-2 on ``dev`` (the same weights every call). ``big``: a size whose ops are not
    all launch overhead on a GPU (the per-op timing check), still a few seconds to trace."""
    net, ids = _gpt2_cpu((1024, 4, 512, 8) if cuda else (192, 2, 64, 4)) if big else _gpt2_cpu((64, 4, 32, 4))
    return Model(copy.deepcopy(net).to(dev), ids.to(dev), dev)


@functools.cache
def _gpt2_cpu(dims: tuple[int, int, int, int]) -> tuple[Any, torch.Tensor]:
    import transformers

    width, layers, seq, batch = dims
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=seq, n_embd=width, n_layer=layers, n_head=8,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                  attn_implementation="eager")
    torch.manual_seed(0)
    net = transformers.GPT2LMHeadModel(cfg).train()
    return net, torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1))


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    """Next-token-free LM loss (labels = inputs): enough to train every parameter; fp32 like HF's own loss."""
    logits = out.logits if hasattr(out, "logits") else out[0]
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def _runner(m: Model, **kwargs: Any) -> Any:
    """Two stages on this one rank: the runtime runs them as interleaved virtual stages (see gpu_check.py)."""
    from smp.engine.planning import pipeline_runner

    return pipeline_runner(m.net, (m.ids[: len(m.ids) // 2],), virtual_stages=2, microbatches=2, loss_fn=lm_loss,
                           target=m.ids[: len(m.ids) // 2], device=m.device, timeout_s=120, **kwargs)


def _grad_error(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None]) -> float:
    """Largest |got - want| over each gradient's largest |want|: the error in units of the tensor's scale."""
    worst = 0.0
    for name, w in want.items():
        g = got.get(name)
        if w is None or g is None:
            raise AssertionError(f"{name}: a gradient is missing (pipelined {g is not None}, "
                                 f"reference {w is not None})")
        worst = max(worst, float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30)))
    return worst


def check_bf16(dev: torch.device) -> Row:
    """1. Pipelined (2 stages, 2 microbatches) vs the plain model, both under torch.autocast(bf16)."""
    ref, m = gpt2(dev), gpt2(dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        want = lm_loss(ref.net(ref.ids), ref.ids)
    want.backward()
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        runner = _runner(m)
        got = runner.step((m.ids,), target=m.ids, loss_fn=lm_loss).loss
    runner.close()
    loss_err = abs(got - float(want)) / abs(float(want))
    grad_err = _grad_error({n: p.grad for n, p in m.net.named_parameters()},
                           {n: p.grad for n, p in ref.net.named_parameters()})
    ok = loss_err <= BF16_LOSS_RTOL and grad_err <= BF16_GRAD_RTOL
    return Row("bf16 pipelined = one device", str(dev), f"loss {got:.4f}, grad err {grad_err:.1e}",
               f"loss {float(want):.4f}, tol {BF16_LOSS_RTOL:.0e}/{BF16_GRAD_RTOL:.0e}",
               f"loss err {loss_err:.1e}", "PASS" if ok else "FAIL")


def check_memory(dev: torch.device) -> Row:
    """2. The plan's stage memory (weights + gradients + activations in flight, both stages: one rank) against the
    allocator's peak over a step. No optimizer runs, so its state is left out of the prediction."""
    _cuda(dev)  # on CPU nothing records a peak: tests/smp/test_tp_memory.py's live_tensor_bytes is a test helper
    # that counts reachable tensors at one moment, not the step's high-water mark
    from partitioner import stage_memory
    from pipeline.schedule import peak_in_flight

    m = gpt2(dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        runner = _runner(m)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        runner.step((m.ids,), target=m.ids, loss_fn=lm_loss)
        torch.cuda.synchronize(dev)
    measured = torch.cuda.max_memory_allocated(dev)
    plan = runner.plan
    runner.close()
    stages = stage_memory(plan, plan.traced_graph(), peak_in_flight(runner.schedule))
    predicted = sum(s.weights_bytes + s.gradient_bytes + s.activation_bytes for s in stages)
    ratio = predicted / measured
    # The model is tiny: the allocator's 512-byte rounding, autocast's weight cache and cuBLAS workspaces weigh
    # more here than at scale, so the band is 2x either way; the ratio itself is what a later session records.
    return Row("stage memory: plan vs peak", str(dev), f"{measured / 2**20:.2f} MiB", f"{predicted / 2**20:.2f} MiB",
               f"{ratio:.2f}", "PASS" if 0.5 <= ratio <= 2.0 else "FAIL")


def device_rates(dev: torch.device) -> tuple[Any, str]:
    """The cost model's rates for ``dev``: the datasheet profile named for the GPU (h100/h200/a100), else
    calibrated here; on CPU this machine's calibrated profile."""
    from partitioner import calibrate, profile

    if dev.type != "cuda":
        return calibrate(), "cpu (calibrated)"
    name = torch.cuda.get_device_name(dev).lower()
    for key, prof in (("h200", "h200-141gb"), ("h100", "h100-80gb"), ("a100", "a100-80gb")):
        if key in name:
            return profile(prof), prof
    return calibrate(str(dev)), f"{dev} (calibrated)"


def check_op_times(dev: torch.device) -> Row:
    """3. The cost model's per-op times (the device's profile) against each op timed (partitioner.measure): the
    median per-op ratio predicted/measured and the step's (sum over ops vs a real forward + backward)."""
    from partitioner import estimate, measure, trace

    m = gpt2(dev, big=True, cuda=dev.type == "cuda")
    rates, name = device_rates(dev)
    # The CPU profile is fp32's (calibrated in fp32); on a GPU the tensor cores' bf16 is what training runs.
    dtype = "bf16" if dev.type == "cuda" else "fp32"
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if dtype == "bf16" else torch.autocast("cpu", enabled=False)
    with ctx:
        graph = trace(m.net, (m.ids,), loss_fn=lm_loss, target=m.ids)
        timed = measure(graph, (m.ids,), repeats=3, rates=rates)
        step = _step_seconds(m)
    pred = estimate(graph, rates, dtype)
    # The ops that make the step (each >= 1 % of it): a view's or a cast's microseconds are dispatch overhead,
    # which the roofline prices as one constant and does not try to match op by op.
    both = (timed.total_s >= 0.01 * timed.total_s.sum()) & (pred.total_s > 0)
    median = statistics.median((pred.total_s[both] / timed.total_s[both]).tolist())
    step_ratio = float(pred.total_s.sum()) / step
    # Bands, not goals: the roofline underprices small CPU shapes ~2x (per-pass costs it leaves to the step model);
    # the first GPU run records where a datasheet profile lands.
    ok = 0.25 <= median <= 4.0 and 0.4 <= step_ratio <= 2.5
    return Row("op times", str(dev), f"step {step * 1e3:.2f} ms, {int(both.sum())} ops",
               f"{name}: step {float(pred.total_s.sum()) * 1e3:.2f} ms", f"op med {median:.2f}, step {step_ratio:.2f}",
               "PASS" if ok else "FAIL")


def _step_seconds(m: Model, repeats: int = 5) -> float:
    """Median seconds of a real forward + backward of the whole model (after a warm-up), on the clock measure()
    times ops with (the thread's CPU time on a one-thread CPU: robust to a loaded machine; wall time on CUDA)."""
    from partitioner.cost.calibration import cost_clock

    clock, times = cost_clock(m.device), []
    for _ in range(repeats + 1):
        _sync(m.device)
        t0 = clock()
        lm_loss(m.net(m.ids), m.ids).backward()
        _sync(m.device)
        times.append(clock() - t0)
    m.net.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def check_offload(dev: torch.device) -> Row:
    """4. Activation offloading (every block checkpointed, its inputs to host memory and back): the same gradients
    bit for bit as the same checkpointed run without offloading. fp32 and deterministic kernels: equality is exact."""
    grads, packs, pins = {}, 0, list[bool]()
    for offload in (False, True):
        m = gpt2(dev)
        blocks = [f"transformer.h.{i}" for i in range(len(m.net.transformer.h))]
        runner = _runner(m, checkpoint_modules=blocks, offload_activations=offload)
        if offload:
            _watch_pinning(runner.offload, pins)
        runner.step((m.ids,), target=m.ids, loss_fn=lm_loss)
        if offload:
            packs = sum(e.kind == "pack" for e in runner.offload.events)
        runner.close()
        grads[offload] = {n: p.grad for n, p in m.net.named_parameters()}
    same = all(torch.equal(grads[True][n], g) for n, g in grads[False].items())
    pinned = bool(pins) and all(pins)
    note = "pinned" if pinned else ("host copies" if dev.type == "cpu" else "NOT pinned")
    ok = same and packs > 0 and (pinned or dev.type == "cpu")
    return Row("offload round trip", str(dev), f"{packs} packs ({note}), grads equal: {same}", "equal, packed",
               "exact" if same else "differ", "PASS" if ok else "FAIL")


def _watch_pinning(offload: Any, pins: list[bool]) -> None:
    """Record whether every host copy the offloader makes is pinned (the copies are gone once loaded back, so they
    are looked at as they are made: a wrapper around its private ``_to_host``)."""
    to_host = offload._to_host

    def watched(t: torch.Tensor) -> torch.Tensor:
        host = to_host(t)
        pins.append(bool(host.is_pinned()))
        return host

    offload._to_host = watched


def check_streams(dev: torch.device) -> Row:
    """5. On CUDA: an async all_reduce behind a 50 ms side-stream sleep, then a matmul on the compute stream. The
    matmul's end (CUDA events) comes long before the collective's, so the compute stream did not wait; after
    work.wait() it does. Then the async paths of grad_buckets and param_gather on this device (single-rank group)."""
    detail = _bucket_and_gather(dev)
    if dev.type != "cuda":
        return Row("async collectives", str(dev), detail, "same results", "-", "PASS")
    compute, side = torch.cuda.current_stream(dev), torch.cuda.Stream(dev)
    a, buf = torch.randn(2048, 2048, device=dev), torch.ones(1 << 24, device=dev)
    (a @ a).sum().item()  # warm cuBLAS and NCCL so the timed launches are launches only
    dist.all_reduce(buf)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    torch.cuda.synchronize(dev)
    events[0].record(compute)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # ~50 ms at 2 GHz: the collective, ordered after it, ends late
        work = dist.all_reduce(buf, async_op=True)
    for _ in range(4):
        a = a @ a / 2048
    events[1].record(compute)
    work.wait()  # makes the current stream wait for the collective
    events[2].record(compute)
    torch.cuda.synchronize(dev)
    matmul_ms, waited_ms = events[0].elapsed_time(events[1]), events[0].elapsed_time(events[2])
    ok = matmul_ms < waited_ms / 2 and float(buf[0]) == 1.0
    return Row("async collectives", str(dev), f"matmul done {matmul_ms:.1f} ms, after wait {waited_ms:.1f} ms",
               f"matmul << wait; {detail}", f"{matmul_ms / waited_ms:.2f}", "PASS" if ok else "FAIL")


def _bucket_and_gather(dev: torch.device) -> str:
    """pipeline.grad_buckets (overlapped buckets, async all_reduce) and pipeline.param_gather (DTensor shards
    gathered where read) over a single-rank group: the same gradients as without them; raises on a difference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from pipeline.grad_buckets import GradBuckets, ReduceGroup
    from pipeline.param_gather import GatheredParams, shard_of

    m = gpt2(dev)
    want = gpt2(dev)
    lm_loss(want.net(want.ids), want.ids).backward()
    runner = _runner(m)
    named = list(m.net.named_parameters())
    buckets = GradBuckets([ReduceGroup("data-parallel", dist.group.WORLD, [], named)], runner.local_stages, set(),
                          0, 60.0, cap_mb=0.05)
    runner.executor.grad_buckets = buckets
    buckets.arm()
    runner.step((m.ids,), target=m.ids, loss_fn=lm_loss)
    count = buckets.finish()
    buckets.close()
    runner.close()
    err = _grad_error({n: p.grad for n, p in named}, {n: p.grad for n, p in want.net.named_parameters()})
    if count[0] < 2 or err > 1e-4:  # fp32 against one process: invariant 2's gradient tolerance
        raise AssertionError(f"grad buckets: {count[0]} all-reduces, gradient error {err:.1e}")
    lin = _TwoLayers().to(dev)
    x = torch.randn(4, 16, device=dev)
    lin(x).square().sum().backward()
    whole = {n: p.grad.clone() for n, p in lin.named_parameters() if p.grad is not None}
    mesh = init_device_mesh(dev.type, (1,))
    for mod in (lin.a, lin.b):
        for name in ("weight", "bias"):
            setattr(mod, name, torch.nn.Parameter(shard_of(getattr(mod, name).detach(), mesh, [Shard(0)])))
    gm = torch.fx.symbolic_trace(lin)
    gathered = GatheredParams(record=True)
    gathered.insert(gm)
    with gathered.saving():
        y = gm(x)
    y.square().sum().backward()
    gathered.reduce_gradients(gm.parameters())
    gerr = max(float((_whole(p.grad) - whole[n]).abs().max()) for n, p in gm.named_parameters())
    if gerr > 1e-5:
        raise AssertionError(f"param gather: gradient error {gerr:.1e}")
    return f"{count[0]} buckets, gather err {gerr:.0e}"


def _whole(grad: torch.Tensor | None) -> torch.Tensor:
    """A DTensor gradient gathered whole (a missing one is a failure)."""
    if grad is None:
        raise AssertionError("param gather: a sharded parameter got no gradient")
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


class _TwoLayers(torch.nn.Module):
    """Parameters read by ``get_attr`` in the traced graph, as the stages read them (what GatheredParams rewrites)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(F.linear(x, self.a.weight, self.a.bias)), self.b.weight, self.b.bias)


def check_nvml(dev: torch.device) -> Row:
    """6. The system monitor samples the GPU's utilisation and memory through NVML."""
    _cuda(dev)  # NVML reads NVIDIA GPUs only
    from pipeline.system_monitor import SystemMonitor
    from pipeline.timeline import Recorder

    try:
        import pynvml  # noqa: F401 -- the `gpu` extra; without it the monitor records no GPU counters by design
    except ImportError as exc:
        raise Skip("nvidia-ml-py not installed (pip install -e '.[gpu]')") from exc
    recorder = Recorder(0)
    monitor = SystemMonitor(recorder, 0.05, dev)
    monitor.start()
    a = torch.randn(4096, 4096, device=dev)
    t_end = time.perf_counter() + 1.0
    while time.perf_counter() < t_end:  # keep the GPU busy while the monitor samples
        a = a @ a / 4096
    torch.cuda.synchronize(dev)
    monitor.stop()
    gpu = [c.values for c in recorder.counters if c.name == "gpu"]
    if not gpu:
        return Row("NVML sampling", str(dev), "no gpu samples", "gpu samples", "-", "FAIL")
    busy, used = max(v["util_percent"] for v in gpu), max(v["memory_used_bytes"] for v in gpu)
    ok = busy > 0 and used >= torch.cuda.memory_allocated(dev)
    return Row("NVML sampling", str(dev), f"{len(gpu)} samples, util {busy:.0f}%, {used / 2**30:.2f} GiB",
               f"util > 0, used >= {torch.cuda.memory_allocated(dev) / 2**30:.2f} GiB", "-", "PASS" if ok else "FAIL")


CHECKS = {"bf16": check_bf16, "memory": check_memory, "op_times": check_op_times, "offload": check_offload,
          "streams": check_streams, "nvml": check_nvml}
