"""Path policies (no mount): which files are checkpoints, which names commit a
checkpoint (markers), which are written under a temporary name (staging), and
which checkpoint (retention unit) a file belongs to, for the layouts the
common training frameworks write."""

from __future__ import annotations

import pytest

from aifs.config import load_config
from aifs.errors import ConfigError
from aifs.policy import (
    CHECKPOINT,
    DATASET,
    DEFAULT,
    DEFAULT_MARKERS,
    DEFAULT_STAGING,
    WEIGHTS,
    Policies,
    matches,
)

BUILTIN = Policies()


# (path, policy, is a commit marker, is a staging name, unit) per framework.
LAYOUTS = {
    "torch.save": [
        ("ckpt/model.pt", CHECKPOINT, False, False, "ckpt/model.pt"),
        ("ckpt/epoch_3.pth", CHECKPOINT, False, False, "ckpt/epoch_3.pth"),
        ("ckpt/last.ckpt", CHECKPOINT, False, False, "ckpt/last.ckpt"),
        ("ckpt/model.pt.tmp", CHECKPOINT, False, True, "ckpt/model.pt.tmp"),
    ],
    "PyTorch DCP": [
        ("run/step_100/__0_0.distcp", CHECKPOINT, False, False, "run/step_100"),
        ("run/step_100/__1_0.distcp", CHECKPOINT, False, False, "run/step_100"),
        ("run/step_100/.metadata", CHECKPOINT, True, False, "run/step_100"),
        ("run/step_100/.metadata.tmp", CHECKPOINT, False, True, "run/step_100"),
        # a DCP directory with a name of its own: the shards' directory is the unit
        ("run/best/__0_0.distcp", CHECKPOINT, False, False, "run/best"),
        ("run/best/.metadata", CHECKPOINT, True, False, None),
    ],
    "DeepSpeed": [
        ("ckpt/global_step200/mp_rank_00_model_states.pt", CHECKPOINT, False, False,
         "ckpt/global_step200"),
        ("ckpt/global_step200/zero_pp_rank_0_mp_rank_00_optim_states.pt", CHECKPOINT,
         False, False, "ckpt/global_step200"),
        # any file in the step directory, whatever its name, is checkpoint data
        ("ckpt/global_step200/extra_state", CHECKPOINT, False, False, "ckpt/global_step200"),
        ("ckpt/latest", CHECKPOINT, True, False, None),
    ],
    "Megatron-LM": [
        ("ckpt/iter_0001000/mp_rank_00/model_optim_rng.pt", CHECKPOINT, False, False,
         "ckpt/iter_0001000"),
        ("ckpt/iter_0001000/mp_rank_01/distrib_optim.pt", CHECKPOINT, False, False,
         "ckpt/iter_0001000"),
        ("ckpt/latest_checkpointed_iteration.txt", CHECKPOINT, True, False, None),
    ],
    "HF Trainer": [
        ("out/checkpoint-500/model.safetensors", CHECKPOINT, False, False,
         "out/checkpoint-500"),
        ("out/checkpoint-500/optimizer.pt", CHECKPOINT, False, False, "out/checkpoint-500"),
        ("out/checkpoint-500/trainer_state.json", CHECKPOINT, True, False,
         "out/checkpoint-500"),
        ("out/tmp-checkpoint-500/model.safetensors", CHECKPOINT, False, True,
         "out/tmp-checkpoint-500"),
        ("out/tmp-checkpoint-500/trainer_state.json", CHECKPOINT, True, True,
         "out/tmp-checkpoint-500"),
    ],
    "torchsnapshot": [
        ("snap/step-7/0/model/weight", CHECKPOINT, False, False, "snap/step-7"),
        ("snap/step-7/.snapshot_metadata", CHECKPOINT, True, False, "snap/step-7"),
    ],
    "Orbax": [
        ("ckpt/100.orbax-checkpoint-tmp-1700000000/default/_METADATA", CHECKPOINT, False,
         True, "ckpt/100.orbax-checkpoint-tmp-1700000000"),
        ("ckpt/100/commit_success.txt", CHECKPOINT, True, False, None),
    ],
    "NeMo": [
        ("nemo/model.nemo", CHECKPOINT, False, False, "nemo/model.nemo"),
        ("nemo/megatron_gpt--step=10-unfinished", CHECKPOINT, False, False,
         "nemo/megatron_gpt--step=10-unfinished"),
    ],
}


@pytest.mark.parametrize("framework", list(LAYOUTS))
def test_framework_layouts(framework):
    for path, policy, marker, staging, unit in LAYOUTS[framework]:
        assert BUILTIN.by_rules(path) == policy, path
        assert BUILTIN.is_marker(path) is marker, path
        assert BUILTIN.is_staging(path) is staging, path
        assert BUILTIN.unit_of(path) == unit, path


def test_other_builtin_policies():
    for path, policy in [
        ("models/llama/model-00001-of-00002.safetensors", WEIGHTS),
        ("models/llama.gguf", WEIGHTS), ("models/pytorch_model.bin", WEIGHTS),
        ("models/model.onnx", WEIGHTS),
        ("data/shard-000001.tar", DATASET), ("data/train/part-0.parquet", DATASET),
        ("data/x.arrow", DATASET), ("data/img/0001.JPEG".lower(), DATASET),
        ("data/train.jsonl", DATASET), ("data/x.tfrecord", DATASET),
        ("notes.txt", DEFAULT), ("src/train.py", DEFAULT), ("README", DEFAULT),
        ("config.json", DEFAULT), ("tokenizer.json", DEFAULT),
        # a name that only looks like a checkpoint directory when it is one
        ("global_step1", DEFAULT), ("checkpoint-1", DEFAULT),
        ("ckpt/latest.txt", DEFAULT), ("trainer_state.json", DEFAULT),
    ]:
        assert BUILTIN.by_rules(path) == policy, path
    # a checkpoint directory wins over the file's own type
    assert BUILTIN.by_rules("out/checkpoint-5/model.safetensors") == CHECKPOINT
    assert BUILTIN.by_rules("out/checkpoint-5/rng_state.bin") == CHECKPOINT
    assert BUILTIN.by_rules("out/checkpoint-5/config.json") == CHECKPOINT


def test_markers_and_staging_outside_checkpoints():
    # markers are names: trainer_state.json is one wherever it is (the policy decides
    # whether it acts as one); staging names are suffixes and directory names
    assert BUILTIN.is_marker("trainer_state.json")
    assert not BUILTIN.is_marker("ckpt/latest.txt")
    assert not BUILTIN.is_marker("ckpt/model.pt")
    assert BUILTIN.is_marker("run/step_1/__0.metadata")
    assert BUILTIN.is_staging("a/b/x.tmp")
    assert BUILTIN.is_staging("a/data.tmp-123/part")
    assert not BUILTIN.is_staging("a/b/x.tmpl")
    assert not BUILTIN.is_staging("out/checkpoint-5/model.pt")
    # a staging directory's own path is not below it
    assert not BUILTIN.is_staging("out/tmp-checkpoint-5")
    assert BUILTIN.is_staging("out/tmp-checkpoint-5/x")


def test_pattern_forms():
    # NAME: the last component only
    assert matches("*.pt", "a/b/c.pt") and not matches("*.pt", "a.pt/c")
    # NAME/: a directory above the file, at any depth
    assert matches("global_step*/", "a/global_step3/b/c.pt")
    assert not matches("global_step*/", "a/global_step3")
    # anything else: the whole path, where * crosses slashes
    assert matches("data/*", "data/a/b.bin") and not matches("data/*", "other/data/a")
    assert matches("/data/*.bin", "data/x.bin")


def test_configured_rules_come_first():
    policies = Policies.from_config(["data/**=dataset", "*.pt=weights", "scratch/=default"],
                                    list(DEFAULT_MARKERS), list(DEFAULT_STAGING))
    assert policies.by_rules("data/ckpt/model.pt") == DATASET  # beats *.pt (built-in)
    assert policies.by_rules("data/run/global_step1/x.pt") == DATASET  # beats global_step*/
    assert policies.by_rules("ckpt/model.pt") == WEIGHTS
    assert policies.by_rules("scratch/checkpoint-1/state.bin") == DEFAULT
    # the built-in rules still apply to what the configured ones do not match
    assert policies.by_rules("run/step_1/__0_0.distcp") == CHECKPOINT
    assert policies.by_rules("x.safetensors") == WEIGHTS
    # and the first configured rule wins over a later one
    first = Policies.from_config(["*.bin=dataset", "*.bin=checkpoint"], [], [])
    assert first.by_rules("a.bin") == DATASET


def test_configured_markers_and_staging_replace_the_defaults():
    policies = Policies.from_config([], ["DONE", ""], ["*.partial", "wip-*/"])
    assert policies.is_marker("run/step_1/DONE")
    assert not policies.is_marker("run/step_1/.metadata")
    assert policies.is_staging("a/x.partial") and policies.is_staging("a/wip-3/x")
    assert not policies.is_staging("a/x.tmp")


def test_config_policy_rules():
    cfg = load_config(None, {"policy_rules": ["data/**=dataset"]}, environ={})
    assert cfg.policies().by_rules("data/model.pt") == DATASET
    env = load_config(None, {}, environ={"AIFS_POLICY_RULES": "a/*=weights,b/*=dataset"})
    assert env.policies().by_rules("a/x.pt") == WEIGHTS
    assert env.policies().by_rules("b/x.pt") == DATASET
    staged = load_config(None, {}, environ={"AIFS_CHECKPOINT_STAGING": "*.part"})
    assert staged.policies().is_staging("x.part") and not staged.policies().is_staging("x.tmp")


@pytest.mark.parametrize("rule", ["x=nope", "x", "=checkpoint", "*.pt=Checkpoint", ""])
def test_bad_rules_are_config_errors(rule):
    with pytest.raises(ConfigError, match="policy rule"):
        load_config(None, {"policy_rules": [rule]}, environ={})


def test_bad_rule_from_the_environment():
    with pytest.raises(ConfigError, match="nope"):
        load_config(None, {}, environ={"AIFS_POLICY_RULES": "*.pt=checkpoint,x=nope"})
