"""SMP v1 config keys: accepted, real where they can be, otherwise warned about once; SMP's real example
configs load; values SMP never had are still errors."""
from __future__ import annotations

import re
import warnings

import pytest

from smp.runtime.compat import NoEffectWarning
from smp.runtime.config import DEFAULT_TIMEOUT_S, ConfigError, load_config

BASE = {"pipeline_parallel_degree": 2}


def _load_recording(config: dict) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(config)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, NoEffectWarning)]


@pytest.mark.parametrize("key,value", [
    ("prescaled_batch", True), ("checkpoint_attentions", True), ("skip_tracing", True), ("static_mode", True),
    ("fast_mode", True), ("fp16_params", True), ("_fp32_grad_accumulation", True), ("_match_weights", True),
    ("sdp_max_live_parameters", 10**8), ("sdp_hierarchical_allgather", False),
    ("sdp_reduce_bucket_size", 10**7),
])
def test_keys_without_effect_are_accepted_with_a_warning(key, value):
    cfg, warned = _load_recording({**BASE, key: value})
    assert getattr(cfg, key) == value
    assert len(warned) == 1 and f"'{key}'={value!r} has no effect" in warned[0], warned


@pytest.mark.parametrize("key,value", [
    ("fp16", True), ("bf16", True), ("delayed_parameter_initialization", True),
    ("sharded_data_parallel_degree", 1), ("activation_loading_horizon", 4), ("overlapping_allreduce", True),
    ("overlapping_allreduce", False),
    ("skip_tracing", False), ("offload_activations", True), ("activation_loading_horizon", 8),
    ("sdp_param_persistence_threshold", 1000), ("sdp_gradient_clipping", 0.5),
])
def test_real_keys_and_default_values_do_not_warn(key, value):
    cfg, warned = _load_recording({**BASE, key: value})
    assert getattr(cfg, key) == value and warned == []


def test_no_effect_warning_is_shown_once_per_call_site():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            load_config({**BASE, "fast_mode": True})
    assert [w.category for w in caught] == [NoEffectWarning], [str(w.message) for w in caught]


def test_smp_gpt2_example_config_loads():
    """The smp_config of aws/amazon-sagemaker-examples' train_gpt_simple.py, with its argument defaults."""
    config = {
        "ddp": True, "tensor_parallel_degree": 1, "pipeline_parallel_degree": 2, "microbatches": 4,
        "shard_optimizer_state": False, "prescaled_batch": False, "fp16": True, "bf16": False,
        "offload_activations": False, "delayed_parameter_initialization": True, "optimize": "speed",
        "placement_strategy": "cluster", "activation_loading_horizon": 4, "skip_tracing": False,
        "auto_partition": True, "default_partition": 0, "static_mode": False, "fast_mode": False,
        "sharded_data_parallel_degree": 1,
    }
    cfg, warned = _load_recording(config)
    assert cfg.fp16 and cfg.delayed_parameter_initialization and warned == []


@pytest.mark.parametrize("config,needle", [
    ({**BASE, "fp16": True, "bf16": True}, "not together with 'bf16'"),
    ({**BASE, "sharded_data_parallel_degree": 2}, "needs 'ddp': True"),
    ({**BASE, "ddp": True, "sharded_data_parallel_degree": 2, "shard_optimizer_state": True},
     "not together with sharded_data_parallel_degree > 1, as in SMP v1"),
    ({**BASE, "sdp_gradient_clipping": -1}, "'sdp_gradient_clipping'=-1 is not valid: a norm >= 0"),
    ({**BASE, "ddp": True, "sharded_data_parallel_degree": 2, "auto_repartition": {"after_steps": 2}},
     "sharded parameters cannot move between stages"),
    ({**BASE, "sharded_data_parallel_degree": 0}, "a positive integer"),
    ({**BASE, "fast_mode": "yes"}, "'fast_mode'='yes' is not valid: True or False"),
    ({**BASE, "fp16": 1}, "'fp16'=1 is not valid: True or False"),
    ({**BASE, "activation_loading_horizon": 0}, "a positive integer"),
    ({**BASE, "activation_loading_horizon": 2.5}, "'activation_loading_horizon'=2.5 is not valid: a positive integer"),
    ({**BASE, "offload_activations": "yes"}, "'offload_activations'='yes' is not valid: True or False"),
    ({**BASE, "fast_mod": True}, "unknown smp config key(s) ['fast_mod'] ('fast_mod': did you mean 'fast_mode'?)"),
    ({**BASE, "zero_stage": 3}, "unknown smp config key(s) ['zero_stage']"),
    ({**BASE, "expert_parallel_degree": 2}, "a degree above 1 shards the experts over data-parallel ranks and needs "
                                            "'ddp': True"),
    ({**BASE, "ddp": True, "expert_parallel_degree": 0}, "'expert_parallel_degree'=0 is not valid: a positive"),
    ({**BASE, "ddp": True, "expert_parallel_degree": 2, "sharded_data_parallel_degree": 2},
     "1 with sharded_data_parallel_degree above 1"),
    ({**BASE, "ddp": True, "expert_parallel_degree": 2, "shard_optimizer_state": True}, "or shard_optimizer_state"),
    ({**BASE, "context_parallel_degree": 2}, "splits each sequence over data-parallel ranks and needs 'ddp': True"),
    ({**BASE, "ddp": True, "context_parallel_degree": 1.5}, "'context_parallel_degree'=1.5 is not valid: a positive"),
    ({**BASE, "ddp": True, "context_parallel_degree": 2, "expert_parallel_degree": 2},
     "1 with sharded_data_parallel_degree or expert_parallel_degree above 1 (not combined yet)"),
    ({**BASE, "ddp": True, "context_parallel_degree": 2, "sequence_parallel": True},
     "None or False with context_parallel_degree above 1"),
])
def test_bad_values_and_unknown_keys_are_errors(config, needle):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert needle in str(err.value)


def test_an_unknown_key_is_told_in_one_short_line_suggestion_first():
    """A typo's message fits a console line: the did-you-mean first, no list of every key (it was 700 characters,
    and ``smp launch`` cut it); a key like none gets a few keys that look like it, and every message says where all
    keys are."""
    messages = {}
    for key in ("microbatchs", "zero_stage"):
        with pytest.raises(ConfigError) as err:
            load_config({**BASE, key: 1})
        messages[key] = str(err.value)
    typo, other = messages["microbatchs"], messages["zero_stage"]
    assert len(typo.splitlines()[0]) < 200 and "\n" not in typo, typo
    assert typo.startswith("unknown smp config key(s) ['microbatchs'] ('microbatchs': did you mean 'microbatches'?)")
    assert "'pipeline_parallel_degree'" not in typo and "docs/smp_api.md" in typo, typo
    assert len(other) < 200 and "keys like 'zero_stage': " in other and "'fast_mode'" not in other, other


def test_timeout_comes_from_config_then_environment(monkeypatch):
    monkeypatch.delenv("SMP_TIMEOUT_S", raising=False)
    assert load_config({"partitions": 2}).timeout_s == DEFAULT_TIMEOUT_S == 60
    monkeypatch.setenv("SMP_TIMEOUT_S", "600")
    assert load_config({"partitions": 2}).timeout_s == 600
    assert load_config({"partitions": 2, "timeout_s": 90}).timeout_s == 90  # the config wins
    monkeypatch.setenv("SMP_TIMEOUT_S", "ten minutes")
    with pytest.raises(ConfigError, match="SMP_TIMEOUT_S='ten minutes' is not valid: a number of seconds"):
        load_config({"partitions": 2})
    with pytest.raises(ConfigError, match="'timeout_s'=0 is not valid: a positive number of seconds"):
        load_config({"partitions": 2, "timeout_s": 0})


def test_profiling_keys_are_checked_and_read(tmp_path):
    from smp.runtime.config import AutoRepartition, ConfigError, load_config

    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    c = load_config({"partitions": 2, "profile": {"dir": "prof", "steps": [10, 20]}, "partition_file": str(plan),
                     "auto_repartition": {"after_steps": 3, "min_gain": 0.1}})
    assert c.profile_options.dir == "prof" and c.profile_options.steps == (10, 20)
    assert c.repartition == AutoRepartition(3, 0.1) and c.repartition.steps == (1, 4)
    assert load_config({"partitions": 2, "profile": {"dir": "p"}}).profile_options.steps == (1, 11)
    bad = [({"profile": {"steps": [1, 2]}}, "(dir required)"),
           ({"profile": {"dir": "p", "steps": [5, 5]}}, "start < stop"),
           ({"profile": {"dir": "p", "every": 2}}, "keys ['dir', 'steps', 'monitor_s']"),
           ({"partition_file": str(tmp_path / "missing.json")}, "existing plan file"),
           ({"auto_repartition": {"after_steps": 0}}, "positive integer"),
           ({"auto_repartition": {"after_steps": 2, "min_gain": -1}}, "'min_gain'"),
           ({"auto_repartition": {"after_steps": 2}, "ddp": True, "shard_optimizer_state": True},
            "shard_optimizer_state"),
           ({"auto_repartition": {"after_steps": 5}, "profile": {"dir": "p", "steps": [3, 8]}}, "start at 6")]
    for keys, needle in bad:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            load_config({"partitions": 2, **keys})


def test_a_config_files_partition_file_is_relative_to_its_folder(tmp_path, monkeypatch):
    import json

    from smp.runtime.config import ConfigError, load_config

    job = tmp_path / "job"
    job.mkdir()
    (job / "job.plan.json").write_text("{}")
    (job / "job.json").write_text(json.dumps({"partitions": 2, "partition_file": "job.plan.json"}))
    monkeypatch.chdir(tmp_path)  # not the config's folder: as smp plan --config writes them, run from elsewhere
    assert load_config("job/job.json").partition_file == str(job / "job.plan.json")
    (job / "abs.json").write_text(json.dumps({"partitions": 2, "partition_file": str(job / "job.plan.json")}))
    assert load_config(str(job / "abs.json")).partition_file == str(job / "job.plan.json")
    with pytest.raises(ConfigError, match="existing plan file"):  # a dict's path stays the process's own
        load_config({"partitions": 2, "partition_file": "job.plan.json"})


# --- tensor parallelism and placement ------------------------------------------------------------------------------

@pytest.mark.parametrize("placement", ["cluster", "spread", "DPT", "DTP", "PDT", "PTD", "TDP", "TPD"])
def test_placements_of_smp_v1_are_accepted(placement):
    cfg, warned = _load_recording({**BASE, "tensor_parallel_degree": 2, "ddp": True, "placement_strategy": placement})
    assert cfg.placement_strategy == placement and cfg.tensor_parallel_degree == 2 and warned == []


def test_prescaled_batch_has_an_effect_with_tensor_parallelism():
    for value in (True, False):
        cfg, warned = _load_recording({**BASE, "tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": value})
        assert cfg.prescaled_batch is value and warned == []
    _, warned = _load_recording({**BASE, "prescaled_batch": True})  # tp = 1: every rank reads its own batch anyway
    assert len(warned) == 1 and "'prescaled_batch'=True has no effect" in warned[0], warned


@pytest.mark.parametrize("config,needle", [
    ({**BASE, "tensor_parallel_degree": 2}, "'tensor_parallel_degree'=2 is not valid: a degree above 1 needs 'ddp': "
                                            "True, as in SMP v1"),
    ({**BASE, "tensor_parallel_degree": 4, "ddp": False}, "'tensor_parallel_degree'=4 is not valid"),
    ({**BASE, "tensor_parallel_degree": 0, "ddp": True}, "'tensor_parallel_degree'=0 is not valid: a positive integer"),
    ({**BASE, "tensor_parallel_degree": 2.0, "ddp": True}, "'tensor_parallel_degree'=2.0 is not valid"),
    ({**BASE, "placement_strategy": "DPD"}, "'placement_strategy'='DPD' is not valid: 'cluster' (= 'DPT'), 'spread' "
                                            "(= 'TPD') or a permutation of the letters 'D'"),
    ({**BASE, "placement_strategy": "dpt"}, "'placement_strategy'='dpt' is not valid"),
    ({**BASE, "placement_strategy": 3}, "'placement_strategy'=3 is not valid"),
])
def test_tensor_parallel_and_placement_errors(config, needle):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert needle in str(err.value)
