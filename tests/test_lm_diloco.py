"""The language-model benchmark (`python -m benchmarks lm_diloco`).

The corpus (examples/minigpt_single.py's stories and byte tokenizer), the
worker section run in this process (plain against one-device AdamW on the
whole batch, and DiLoCo's bytes), the report's target, bounds and ratios on
made-up runs, the options; then one end-to-end smoke run on shared memory,
which starts its own `mpirun` job, so it runs from plain pytest only (its
name has "subprocess").
"""

import functools
import json

import jax
import numpy as np
import optax
import pytest

from benchmarks import __main__ as entry
from benchmarks.harness import worker
from benchmarks.sections import lm_diloco
from benchmarks.sections.lm_diloco import train as lm_train
from tests import launch

SIZES = {"batch": 2, "seq": 16, "embed": 16, "blocks": 1, "lr": 3e-3, "stories": 60,
         "validation_stories": 8}


def test_corpus_is_the_examples_stories_cut_into_windows():
  defs = lm_train.example_definitions()
  tokenizer = defs["ByteTokenizer"]()
  text = defs["tiny_stories"](3, seed=0)
  tokens = tokenizer.encode(text, allowed_special={tokenizer.eot})
  assert tokenizer.decode(tokens) == text and tokens.count(256) == 3
  corpus = lm_train.load_corpus(3, 2, seq=16)
  assert corpus.train.shape == (len(tokens) // 17, 17) and corpus.train_tokens == len(tokens)
  np.testing.assert_array_equal(corpus.train.ravel(), tokens[:corpus.train.size])
  held_out = tokenizer.encode(defs["tiny_stories"](2, seed=lm_train.VALIDATION_SEED),
                              allowed_special={tokenizer.eot})
  np.testing.assert_array_equal(corpus.validation.ravel(), held_out[:corpus.validation.size])
  assert corpus.vocab_size == tokenizer.n_vocab


def _section_rows(topo, variant: str, steps: int, eval_every: int) -> list[dict]:
  options = dict(SIZES, variant=variant, eval_every=eval_every,
                 tokens=steps * topo.replica_count * SIZES["batch"] * SIZES["seq"])
  return list(lm_train.run(worker.Context("test", True, topo, options)))


def _one_device_losses(replicas: int, steps: int, eval_every: int) -> list[float]:
  """AdamW on every replica's windows as one batch, one device: plain's reference."""
  corpus = lm_train.load_corpus(SIZES["stories"], SIZES["validation_stories"], SIZES["seq"])
  model, params = lm_train.build_model(corpus, SIZES["seq"], SIZES["embed"], SIZES["blocks"])
  tx = optax.adamw(SIZES["lr"])
  state = tx.init(params)
  validate = lm_train.make_validate(model, corpus.validation)

  @jax.jit
  def step_fn(params, state, windows):
    grads = jax.grad(functools.partial(lm_train.loss, model))(params, windows)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  losses = []
  for step, indices in enumerate(lm_train.batches(corpus, replicas, SIZES["batch"], steps), 1):
    params, state = step_fn(params, state, corpus.train[indices.ravel()])
    if step % eval_every == 0:
      losses.append(validate(params))
  return losses


def test_plain_trains_as_one_device_adamw_on_the_whole_batch(topo):
  rows = _section_rows(topo, "plain", steps=6, eval_every=3)
  curve, final = rows[:-1], rows[-1]
  expected = _one_device_losses(topo.replica_count, steps=6, eval_every=3)
  assert [p["step"] for p in curve] == [3, 6] and final["kind"] == "final"
  np.testing.assert_allclose([p["val_loss"] for p in curve], expected, rtol=2e-5)
  assert curve[-1]["val_loss"] < curve[0]["val_loss"] == pytest.approx(expected[0], rel=2e-5)
  tokens_per_step = topo.replica_count * SIZES["batch"] * SIZES["seq"]
  assert final["tokens"] == 6 * tokens_per_step == curve[-1]["tokens"]
  assert final["steps"] == final["steps_planned"] == 6 and not final["capped"]
  assert final["val_loss"] == curve[-1]["val_loss"] and final["train_s"] > 0
  assert "test_accuracy" not in final and "time_to_target_s" not in final


def test_diloco_sends_once_every_h_steps(topo):
  plain = _section_rows(topo, "plain", steps=8, eval_every=8)[-1]
  diloco = _section_rows(topo, "diloco8", steps=8, eval_every=8)[-1]
  assert np.isfinite(diloco["val_loss"]) and diloco["steps"] == 8
  if topo.process_count == 1:  # nothing crosses processes
    assert plain["wire_bytes_per_step"] == diloco["wire_bytes_per_step"] == 0
  else:  # one parameter exchange in 8 steps against a gradient exchange per step
    assert 0 < diloco["wire_bytes_per_step"] <= plain["wire_bytes_per_step"] / 6


def test_sparseloco_variants_send_under_a_thousandth_of_plains_bytes(topo):
  assert {"diloco16_sparse", "diloco32_sparse", "diloco32_sparse1",
          "diloco32_sparse3"} <= set(lm_train.VARIANTS)
  plain = _section_rows(topo, "plain", steps=2, eval_every=2)[-1]
  sparse = _section_rows(topo, "diloco32_sparse", steps=32, eval_every=32)[-1]
  assert np.isfinite(sparse["val_loss"]) and sparse["steps"] == 32
  if topo.process_count == 1:
    assert plain["wire_bytes_per_step"] == sparse["wire_bytes_per_step"] == 0
  else:  # one sync of the top 2% in 2 bits (2.25 bytes an entry) in 32 steps
    assert 0 < sparse["wire_bytes_per_step"] <= plain["wire_bytes_per_step"] / 1000


def _run(variant, link, losses, *, every=100, planned=4, capped=False, seconds=10.0):
  curve = [{"kind": "eval", "step": every * (i + 1), "tokens": 1000 * every * (i + 1),
            "train_s": seconds * (i + 1), "val_loss": loss} for i, loss in enumerate(losses)]
  final = {"kind": "final", "steps": every * len(losses), "steps_planned": every * planned,
           "tokens_per_step": 1000, "tokens": 1000 * every * len(losses), "capped": capped,
           "train_s": seconds * len(losses), "median_step_s": seconds / every,
           "first_step_s": seconds / every, "wire_bytes_per_step": 100.0,
           "val_loss": losses[-1], "parameters": 10, "blocks": 1, "embed": 4, "seq": 8,
           "train_tokens": 900, "train_windows": 100, "validation_windows": 10,
           "replicas": 2, "batch_per_replica": 4, "eval_every": every}
  return {"link": link, "variant": variant, "curve": curve, "final": final, "error": None,
          "wall_s": 1.0}


def _results(runs, target_at=0.5):
  return {"runs": runs, "options": {"target_at": target_at}}


def test_target_is_plains_loss_at_a_fraction_of_the_tokens_from_an_uncapped_run():
  runs = [_run("plain", "10mbit", [3.0], capped=True, seconds=60),
          _run("plain", "100mbit", [3.0, 2.0, 1.5, 1.2]),
          _run("diloco32", "10mbit", [3.5, 2.5, 1.9, 1.3], seconds=2)]
  summary = lm_diloco.summarize(_results(runs))
  assert summary["target"] == {"loss": 2.0, "tokens": 200_000, "step": 200,
                               "from": "plain@100mbit"}
  assert summary["plain_loss"] == 1.2 and summary["plain_loss_from"] == "plain@100mbit"
  slow = {r["variant"]: r for r in summary["links"]["10mbit"]}
  # plain capped before the target: its seconds bound its time, so DiLoCo's ratio is <=.
  assert slow["plain"]["time_to_target_s"] is None and slow["plain"]["target_kind"] == ">="
  assert slow["plain"]["loss_vs_plain"] is None  # capped: not at equal tokens
  assert slow["diloco32"]["time_to_target_s"] == 6 and slow["diloco32"]["tokens_to_target"] == 300_000
  assert slow["diloco32"]["vs_plain"] == pytest.approx(0.1)
  assert slow["diloco32"]["vs_plain_kind"] == "<="
  assert slow["diloco32"]["loss_vs_plain"] == pytest.approx(0.1)
  fast = summary["links"]["100mbit"]
  assert fast[0]["time_to_target_s"] == 20 and fast[0]["vs_plain"] == 1.0
  text = lm_diloco.markdown(dict(
      _results(runs), summary=summary, command="python -m benchmarks lm_diloco",
      wall_s=60.0, skipped=[], environment={
          "cpu": "cpu", "cores": 2, "date": "today", "versions": {"jax": "0"},
          "load_average_start": [1.0, 1.0, 1.0]}) | {"options": {"target_at": 0.5, "lr": 1e-3}})
  assert "## 10mbit" in text and ">= 60.0 (not reached, capped)" in text and "<= 0.1" in text


def test_no_target_without_a_plain_run_that_got_there():
  summary = lm_diloco.summarize(_results([_run("diloco32", "shm", [2.0, 1.0])]))
  assert summary["target"]["loss"] is None and summary["plain_loss"] is None
  row = summary["links"]["shm"][0]
  assert row["time_to_target_s"] is None and row["vs_plain"] is None


def test_options_default_quick_and_reject_unknown_variants(capsys):
  args = entry.parse_args(["lm_diloco", "--quick"])
  assert args.links == ["shm"] and args.variants == [("plain", "shm"), ("diloco8", "shm")]
  assert (args.tokens, args.batch, args.seq, args.embed, args.blocks) == (16384, 4, 32, 32, 1)
  args = entry.parse_args(["lm_diloco", "--links", "10mbit,100mbit", "--variants",
                           "plain,diloco32@10mbit", "--max-seconds-of", "plain@10mbit=60"])
  assert args.variants == [("plain", "10mbit"), ("plain", "100mbit"), ("diloco32", "10mbit")]
  assert args.caps == {("plain", "10mbit"): 60.0} and args.tokens == 2 ** 20
  for bad in (["--variants", "topk1%+mc"], ["--target-at", "0"], ["--tokens", "0"]):
    with pytest.raises(SystemExit):
      entry.parse_args(["lm_diloco", *bad])
  assert "topk1%+mc" in capsys.readouterr().err


def test_quick_command_runs_end_to_end_in_a_subprocess(tmp_path, topo):
  if topo.process_count > 1:
    pytest.skip("starts its own MPI jobs: runs from plain pytest only")
  result = launch.python(["-m", "benchmarks", "lm_diloco", "--quick", "--variants", "plain",
                          "--tokens", "8192", "--out", str(tmp_path)], timeout=280)
  assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
  results = json.loads((tmp_path / "lm_diloco.json").read_text())
  (run,) = results["runs"]
  assert run["error"] is None and run["link"] == "shm" and len(run["curve"]) == 2
  assert run["curve"][-1]["val_loss"] < run["curve"][0]["val_loss"]
  assert run["final"]["steps"] == 32 and run["final"]["train_s"] > 0
  assert results["summary"]["target"]["from"] == "plain@shm"
  assert "## shm" in (tmp_path / "lm_diloco.md").read_text()
