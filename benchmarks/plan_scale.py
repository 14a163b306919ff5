"""``smp plan`` at the scale it is meant for: Llama-3 8B, 70B and 405B shapes on 64 to 2,048 H100s.

Each row runs the command as a user does, in a subprocess, on a factory target of this file (``llama3_8b``,
``llama3_70b``, ``llama3_405b``: ``transformers.LlamaConfig`` with the published shapes, built on the meta device,
one sequence of 8,192 token ids per microbatch; nothing is downloaded and no weight is allocated), for ``h100-80gb``
in ``bf16`` with a global batch of one sequence per device. It prints the wall time, the subprocess's CPU time
(user + system, which a busy machine inflates less) and its peak RSS (read by the subprocess itself at exit), what
the search did (layouts enumerated, priced, partitions made) and the layout it chose, with the load average before
and after: other work on the machine slows the run, not its memory. Goal (issue 24): the 70B shape on 1,024 devices
planned in under 60 s and 2 GB (``--goal`` runs that row alone).

``--sc21`` runs the GPT shapes of Narayanan et al. (SC'21, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", Table 1: 18.4B on 256 A100s .. 1008B on 3,072) instead, each on its row's devices and
global batch (:data:`benchmarks.published.ROWS`, the ``sc21-*`` rows; factory ``sc21_gpt``), ``a100-80gb`` in
``bf16``: the search ``benchmarks/published.py`` runs for the planner's best layout of each row. Goal (issue 40):
each under 60 s, the chosen layout unchanged. Each row also gives the 1-minute load average when it started.

Mixtures of experts (factories for ``smp plan``, not rows of the table): ``mixtral_8x7b`` and ``deepseek_v3``, the
published shapes (:data:`MOE`) on the meta device with one sequence of :data:`MOE_SEQ` token ids, and
``deepseek_v3_16_layers``, DeepSeek-V3's first 16 layers (3 dense, 13 of experts) with its embedding and head: the
whole model cannot train on 64 H100s in any layout (its 653B parameters of experts hold 16 bytes each of
mixed-precision Adam state, 163 GB a device over the 64 that pp x ep can split them across).

Run: ``python benchmarks/plan_scale.py [--shapes 8b,70b,405b] [--devices 64,512,2048] [--goal] [--seq 8192]`` or
``python benchmarks/plan_scale.py --sc21 [18.4B,39.1B,...]``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import LossOnly, llama_on_meta, load_average  # noqa: E402
from partitioner.units import format_bytes  # noqa: E402

__all__ = ["LLAMA3", "SC21", "MOE", "MOE_SEQ", "llama3", "llama3_8b", "llama3_70b", "llama3_405b", "llama3_8b_128k",
           "sc21_gpt", "moe_on_meta", "mixtral_8x7b", "deepseek_v3", "deepseek_v3_16_layers", "main"]

REPO = Path(__file__).resolve().parents[1]
# (layers, hidden, intermediate, heads, KV heads, vocabulary): Llama 3 / 3.1 (Dubey et al. 2024, "The Llama 3 Herd
# of Models", arXiv:2407.21783, table 3).
LLAMA3 = {"8b": (32, 4096, 14336, 32, 8, 128256), "70b": (80, 8192, 28672, 64, 8, 128256),
          "405b": (126, 16384, 53248, 128, 8, 128256)}
SEQ = int(os.environ.get("PLAN_SCALE_SEQ", "8192"))  # the factories' sequence length (--seq sets it)
# The SC'21 GPT rows of benchmarks/published.py that --sc21 plans (the smaller ones fit one node or eight).
SC21 = ("18.4B", "39.1B", "76.1B", "145.6B", "310.1B", "529.6B", "1008B")
TIME_GOAL_S, RSS_GOAL_BYTES = 60.0, 2e9
# Published mixture-of-experts shapes, as transformers' config keywords: Mixtral 8x7B (Jiang et al. 2024,
# arXiv:2401.04088) and DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437: MLA attention, 256 routed experts and one
# shared, top-8 in 8 groups of which 4 are chosen, the first 3 layers dense).
MOE = {"mixtral": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000),
       "deepseek_v3": dict(num_hidden_layers=61, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                           n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
                           first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128,
                           q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                           v_head_dim=128, vocab_size=129280)}
MOE_SEQ = 4096  # tokens per sequence of the mixture-of-experts factories (DeepSeek-V3's pre-training length)
# The subprocess: run `smp plan`, then print its own peak RSS (KiB on Linux) on the last line of stderr.
_RUN = ("import resource, sys; from smp.cli import main; rc = main(sys.argv[1:]); "
        "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(rc)")


def llama3(shape: str, seq: int = SEQ) -> tuple[torch.nn.Module, tuple]:
    """A Llama-3-shaped causal LM (``shape``: a key of :data:`LLAMA3`) on the meta device and one sequence."""
    return llama_on_meta(LLAMA3[shape], seq)


def llama3_8b() -> tuple:
    """The ``smp plan`` factory of the 8B shape."""
    return llama3("8b")


def llama3_70b() -> tuple:
    """The ``smp plan`` factory of the 70B shape."""
    return llama3("70b")


def llama3_405b() -> tuple:
    """The ``smp plan`` factory of the 405B shape."""
    return llama3("405b")


def llama3_8b_128k() -> tuple:
    """The ``smp plan`` factory of the 8B shape on one sequence of 131,072 tokens (Llama 3.1's context), long enough
    that the search splits it over ranks (context parallelism), its loss computed in the model and the only output
    (a context-parallel run would gather any output whole: the logits of 131,072 tokens are 34 GB in bf16)."""
    model, (ids,) = llama3("8b", 131072)
    return LossOnly(model), (ids, ids)


def sc21_gpt() -> tuple:
    """The ``smp plan`` factory of the SC'21 GPT row named by ``PLAN_SCALE_SC21`` (``18.4B`` .. ``1008B``)."""
    from benchmarks.published import build

    return build(_sc21_row(os.environ["PLAN_SCALE_SC21"]))


def moe_on_meta(kind: str, **changes: int) -> tuple[torch.nn.Module, tuple]:
    """A mixture-of-experts causal LM of :data:`MOE` (``kind``, its config keywords updated with ``changes``) on the
    meta device, and one sequence of :data:`MOE_SEQ` token ids."""
    import transformers

    config = {"mixtral": transformers.MixtralConfig, "deepseek_v3": transformers.DeepseekV3Config}[kind]
    cfg = config(**{**MOE[kind], **changes}, max_position_embeddings=MOE_SEQ, use_cache=False)
    model = {"mixtral": transformers.MixtralForCausalLM, "deepseek_v3": transformers.DeepseekV3ForCausalLM}[kind]
    with torch.device("meta"):
        return model(cfg), (torch.zeros(1, MOE_SEQ, dtype=torch.long),)


def mixtral_8x7b() -> tuple:
    """The ``smp plan`` factory of Mixtral 8x7B's shape."""
    return moe_on_meta("mixtral")


def deepseek_v3() -> tuple:
    """The ``smp plan`` factory of DeepSeek-V3's shape (671B parameters)."""
    return moe_on_meta("deepseek_v3")


def deepseek_v3_16_layers() -> tuple:
    """The ``smp plan`` factory of DeepSeek-V3's first 16 layers (see the module docstring)."""
    return moe_on_meta("deepseek_v3", num_hidden_layers=16)


def _sc21_row(name: str) -> Any:
    from benchmarks.published import ROWS

    return next(r for r in ROWS if r.key == f"sc21-{name}")


def _row(shape: str, devices: int, seq: int, batch: int | None = None) -> tuple[list[str], float, int]:
    """Plan one shape on ``devices`` devices (a global batch of ``batch``, default one sequence per device) in a
    subprocess: the row's cells, its wall seconds and peak RSS. A shape of :data:`SC21` is that GPT row, on A100s."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        gpt = shape in SC21
        factory, device = ("sc21_gpt", "a100-80gb") if gpt else (f"llama3_{shape}", "h100-80gb")
        argv = ["plan", f"{Path(__file__).resolve()}:{factory}", "--devices", str(devices), "--global-batch",
                str(batch or devices), "--device", device, "--dtype", "bf16", "--top", "1", "--json", str(out), "-q"]
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PLAN_SCALE_SEQ=str(seq), PLAN_SCALE_SC21=shape, OMP_NUM_THREADS="1")
        load = f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "-"
        t0, c0 = time.perf_counter(), os.times()
        done = subprocess.run([sys.executable, "-c", _RUN, *argv], capture_output=True, text=True, cwd=REPO, env=env)
        wall, c1 = time.perf_counter() - t0, os.times()
        cpu = (c1.children_user - c0.children_user) + (c1.children_system - c0.children_system)
        rss = next((int(line.split()[1]) * 1024 for line in done.stderr.splitlines()
                    if line.startswith("peak_rss_kib")), 0)
        if done.returncode != 0 or not out.exists():
            why = (done.stderr.strip().splitlines() or ["?"])[-2 if rss else -1]
            failed = [shape, str(devices), f"{wall:.1f}", f"{cpu:.1f}", format_bytes(rss), load, "-", "-", "-",
                      why[:80]]
            return failed, wall, rss
        data = json.loads(out.read_text())
    best, search = data["layouts"][0], data["search"]
    ep = f" ep{best['ep']}" if best.get("ep", 1) > 1 else ""
    layout = (f"pp{best['pp']} tp{best['tp']}{ep} dp{best['dp']} {best['microbatches']}x{best['microbatch_size']} "
              f"{best['schedule']}{' ckpt' if best['checkpointing'] != 'none' else ''}"
              f"{' zero1' if best['zero1'] else ''}: step {best['step_s']:.2f} s, MFU {100 * best['mfu']:.1f}%")
    return [shape, str(devices), f"{wall:.1f}", f"{cpu:.1f}", format_bytes(rss), load, str(search["enumerated"]),
            str(search["scored"]), str(search["partitions"]), layout], wall, rss


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8b,70b,405b")
    ap.add_argument("--devices", default="64,512,2048")
    ap.add_argument("--seq", type=int, default=SEQ, help="tokens per sequence (default 8192)")
    ap.add_argument("--goal", action="store_true", help="only the goal's row: 70b on 1024 devices")
    ap.add_argument("--sc21", nargs="?", const=",".join(SC21), metavar="NAMES",
                    help=f"the SC'21 GPT rows instead (default all: {','.join(SC21)}), on their devices and batch")
    opts = ap.parse_args(argv)
    runs: list[tuple[str, int, int | None]]
    if opts.sc21:
        runs = [(n, _sc21_row(n).devices, _sc21_row(n).global_batch) for n in opts.sc21.split(",")]
        print(f"# smp plan on the SC'21 GPT shapes (meta), a100-80gb, bf16, sequence 2048, each row's devices and "
              f"global batch; before: {load_average()}", flush=True)
    else:
        runs = [("70b", 1024, None)] if opts.goal else [(s, int(d), None) for s in opts.shapes.split(",")
                                                       for d in opts.devices.split(",")]
        print(f"# smp plan on Llama-3 shapes (meta), h100-80gb, bf16, sequence {opts.seq}, global batch = devices; "
              f"before: {load_average()}", flush=True)
    header = ["shape", "devices", "wall s", "CPU s", "peak RSS", "load", "layouts", "priced", "partitions", "best"]
    rows: list[list[str]] = []
    missed: list[str] = []
    for shape, devices, batch in runs:
        cells, wall, rss = _row(shape, devices, opts.seq, batch)
        rows.append(cells)
        print("  " + "  ".join(cells), flush=True)
        if (shape, devices) == ("70b", 1024):
            missed += [f"wall {wall:.1f} s > {TIME_GOAL_S:.0f} s"] * (wall > TIME_GOAL_S)
            missed += [f"peak RSS {format_bytes(rss)} > 2 GB"] * (rss > RSS_GOAL_BYTES)
        if opts.sc21 and wall > TIME_GOAL_S:
            missed.append(f"{shape} {wall:.1f} s")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print("\n".join("  ".join(c.rjust(w) if i < len(header) - 1 else c for i, (c, w) in enumerate(zip(r, widths)))
                    for r in [header, ["-" * w for w in widths], *rows]))
    print(f"# after: {load_average()}")
    if ("70b", 1024, None) in runs:
        print("# goal, 70b on 1024 devices under 60 s and 2 GB: " + ("MISSED: " + "; ".join(missed) if missed
                                                                      else "met"))
    if opts.sc21:
        print("# goal, every SC'21 shape under 60 s: " + ("MISSED: " + "; ".join(missed) if missed else "met"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
