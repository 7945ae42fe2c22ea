"""`jdist.app.optimizer_spec`: every optimizer flag of `jdist train` reaches the optimizer that runs.

The check goes through the real path: flags -> `cli.parse_train_args` ->
`TrainConfig.optimizer_spec` -> the trainer's cached `_program(...).tx`, then
runs that transformation for a few steps under `jdist.data_parallel` and
compares its updates and state with the run without the flag. A flag that
the trainer drops on the way (as `--momentum-correction` once was) fails.
"""

import dataclasses

import jax
import numpy as np
import pytest

import jdist
from jdist.app import cli
from jdist.app import config as config_lib
from jdist.app import optimizer_spec
from jdist.app import resume_policy
from jdist.app import train as train_lib
from jdist.app.optimizer_spec import OptimizerSpec

# Each optimizer flag of `jdist train`: (arguments without it, arguments with it).
FLAG_CASES = {
    "--optimizer": ([], ["--optimizer", "adam"]),
    "--lr": ([], ["--lr", "0.01"]),
    "--momentum": ([], ["--momentum", "0.5"]),
    "--weight-decay": ([], ["--weight-decay", "0.01"]),
    "--half": ([], ["--half", "fp16"]),
    "--sparsify": ([], ["--sparsify", "topk:0.5"]),
    "--momentum-correction": (["--sparsify", "topk:0.5"],
                              ["--sparsify", "topk:0.5", "--momentum-correction"]),
    "--partial": ([], ["--partial", "2"]),
    "--powersgd": ([], ["--powersgd", "2"]),
    "--qsgd": ([], ["--qsgd"]),
    "--signsgd": ([], ["--signsgd"]),
    "--skip-nonfinite": ([], ["--skip-nonfinite"]),
    "--diloco": ([], ["--diloco", "2"]),
    "--diloco-fragments": (["--diloco", "2"], ["--diloco", "2", "--diloco-fragments", "2"]),
    "--diloco-outer-lr": (["--diloco", "2"], ["--diloco", "2", "--diloco-outer-lr", "0.5"]),
    "--diloco-backoff": (["--diloco", "2"], ["--diloco", "2", "--diloco-backoff"]),
    "--diloco-outer-momentum": (["--diloco", "2"],
                                ["--diloco", "2", "--diloco-outer-momentum", "0.5"]),
    "--diloco-payload": (["--diloco", "2"], ["--diloco", "2", "--diloco-payload", "int8"]),
    "--diloco-delay": (["--diloco", "2"], ["--diloco", "2", "--diloco-delay", "1"]),
    "--diloco-mix": (["--diloco", "2", "--diloco-delay", "1"],
                     ["--diloco", "2", "--diloco-delay", "1", "--diloco-mix", "0.5"]),
    "--local-sgd": ([], ["--local-sgd", "2"]),
    "--local-sgd-warmup": (["--local-sgd", "2"], ["--local-sgd", "2", "--local-sgd-warmup", "2"]),
}
# Flags of the same argument groups that do not build the optimizer.
NOT_OPTIMIZER = {"--epochs", "--batch-size", "--eval-batch-size", "--seed", "--max-steps",
                 "--on-nonfinite",  # what the trainer does after a non-finite step
                 "--check-replicas-every"}
OPTIMIZER_GROUPS = ("optimization", "communication")


def _optimizer_flags() -> set:
  """Every flag of `jdist train` in the optimization and communication groups."""
  parser = cli.build_train_parser()
  flags = set()
  for group in parser._action_groups:  # pylint: disable=protected-access
    if group.title and group.title.startswith(OPTIMIZER_GROUPS):
      flags.update(action.option_strings[0] for action in group._group_actions)  # pylint: disable=protected-access
  return flags


def test_every_optimizer_flag_is_a_spec_field_with_a_case():
  flags = _optimizer_flags()
  spec_flags = {"--" + name.replace("_", "-") for name in optimizer_spec.FIELDS}
  unclassified = flags - spec_flags - NOT_OPTIMIZER
  assert not unclassified, (
      f"{sorted(unclassified)}: a new optimizer flag must be a field of OptimizerSpec "
      f"(which builds the optimizer), or be listed in NOT_OPTIMIZER here")
  assert spec_flags <= flags, f"spec fields without a flag: {sorted(spec_flags - flags)}"
  assert set(FLAG_CASES) == spec_flags


def test_spec_defaults_and_resume_lists_derive_from_the_spec():
  assert config_lib.TrainConfig().optimizer_spec == OptimizerSpec()
  for name in optimizer_spec.FIELDS:
    assert name in resume_policy.RESUME_MUST_MATCH + resume_policy.RESUME_MAY_DIFFER, name
  assert "momentum_correction" in resume_policy.RESUME_MUST_MATCH
  assert {"lr", "momentum", "weight_decay", "diloco_mix"} == set(
      resume_policy.RESUME_MAY_DIFFER)
  assert "diloco_delay" in resume_policy.RESUME_MUST_MATCH  # it shapes the state
  spec = OptimizerSpec(half="bf16", sparsify="topk:0.01", momentum_correction=True)
  assert spec.describe() == "half bf16, sparsify topk:0.01 with momentum correction"
  assert hash(spec) == hash(dataclasses.replace(spec))  # the cache key


def _running_tx(argv, topo):
  """The transformation the trainer builds for these flags."""
  config, _ = cli.parse_train_args(argv + ["--model", "mlp"])
  program = train_lib._program("mlp", 5, (6,), config.optimizer_spec, topo)  # pylint: disable=protected-access
  return program.tx


def _fingerprint(tx, topo):
  """Updates of four steps (the third with a NaN gradient) and the final state."""
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(6, 5)).astype(np.float32),
            "b": rng.normal(size=(5,)).astype(np.float32)}
  grads = [jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
           for _ in range(4)]
  grads[2]["b"][1] = np.nan
  local = jdist.replicate(params)
  state = jdist.data_parallel(tx.init)(local)
  step = jdist.data_parallel(tx.update)
  updates = []
  for grad in grads:
    update, state = step(jdist.replicate(grad), state, local)
    updates.append(jax.device_get(jdist.unreplicate(update)))
  state = jax.device_get(jdist.unreplicate(state))
  return str(jax.tree.structure(state)), updates, jax.tree.leaves(state)


def _same(a, b) -> bool:
  if a[0] != b[0]:
    return False
  left, right = jax.tree.leaves((a[1], a[2])), jax.tree.leaves((b[1], b[2]))
  return len(left) == len(right) and all(
      np.shape(x) == np.shape(y) and np.array_equal(x, y, equal_nan=True)
      for x, y in zip(left, right))


@pytest.mark.parametrize("flag", sorted(FLAG_CASES))
def test_each_optimizer_flag_changes_the_optimizer_that_runs(flag, topo):
  without, with_flag = FLAG_CASES[flag]
  assert not _same(_fingerprint(_running_tx(without, topo), topo),
                   _fingerprint(_running_tx(with_flag, topo), topo)), (
      f"{flag} does not change the optimizer that jdist train runs")


def test_same_flags_build_the_same_optimizer(topo):
  argv = ["--sparsify", "topk:0.5", "--half", "bf16"]
  assert _same(_fingerprint(_running_tx(argv, topo), topo),
               _fingerprint(_running_tx(list(argv), topo), topo))


def test_momentum_correction_changes_the_trained_run(topo):
  """`--sparsify topk:0.01 --momentum-correction` once trained without the correction."""
  runs = []
  for correction in (False, True):
    config, _ = cli.parse_train_args(
        ["--model", "mlp", "--epochs", "2", "--train-limit", "256", "--eval-every", "0",
         "--batch-size", str(64 // topo.replica_count), "--sparsify", "topk:0.01",
         "--no-progress"] + (["--momentum-correction"] if correction else []))
    runs.append(train_lib.train(config, return_state=True))
  losses = [[record["train_loss"] for record in run["epochs"]] for run in runs]
  assert losses[0][0] == pytest.approx(losses[1][0], rel=0.05)  # the same start...
  assert losses[0] != losses[1]  # ...and another optimizer
  assert runs[1]["config"]["momentum_correction"]
  params = [jax.tree.leaves(run["state"]["params"]) for run in runs]
  assert any(not np.allclose(a, b) for a, b in zip(*params))


def test_diloco_outer_step_defaults_to_the_inner_optimizers_momentum():
  """The paper's outer step is set for an inner AdamW; SGD's heavy-ball momentum takes its share."""
  def settings(**kw):
    return OptimizerSpec(diloco=8, **kw).outer_settings()[:2]
  assert settings() == (0.7, 0.0)  # sgd, momentum 0.9: no outer momentum
  assert settings(momentum=0.5) == (0.7, 0.8)  # 1 / (1 - 0.8) x 1 / (1 - 0.5) = 10
  assert settings(momentum=0.0) == (0.7, 0.9)  # the paper's
  assert settings(momentum=0.99) == (0.07, 0.0)  # past 0.9 the lr takes the rest
  assert settings(optimizer="adamw") == settings(optimizer="adam") == (0.7, 0.9)
  assert settings(diloco_outer_lr=0.3) == (0.3, 0.0)
  # SparseLoCo's outer step over the sparse payload: no momentum; lr 1 with adam/adamw.
  assert settings(optimizer="adamw", diloco_payload="sparse") == (1.0, 0.0)
  assert settings(diloco_payload="sparse:0.01", momentum=0.0) == (0.7, 0.0)
  assert settings(diloco_payload="sparse") == (0.7, 0.0)  # the main job's, measured: 97.78%
  assert settings(optimizer="adam", diloco_payload="sparse", diloco_outer_momentum=0.9) == (
      1.0, 0.9)
  assert settings(diloco_outer_momentum=0.5) == (0.7, 0.5)
  assert OptimizerSpec(diloco=8).describe() == (
      "diloco every 8 steps, outer lr 0.7, Nesterov momentum 0 (scaled to SGD's heavy-ball "
      "momentum 0.9: outer x inner momentum gain = the paper's 10)")
  assert "outer lr 0.7, Nesterov momentum 0.9 (the DiLoCo paper's)" in OptimizerSpec(
      diloco=8, optimizer="adam").describe()
  assert "(--diloco-outer-lr; else scaled" in OptimizerSpec(
      diloco=8, diloco_outer_lr=0.3).describe()
  assert "halved if the loss rises" in OptimizerSpec(diloco=8, diloco_backoff=True).describe()
