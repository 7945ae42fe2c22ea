"""The `jdist` command: `jdist train ...`, `jdist info`, `jdist bench ...`, `jdist launch ...`.

    jdist train --model cnn --dataset digits --epochs 3 --batch-size 32
    mpirun -np 2 jdist train --cpu-devices 2 --sparsify topk:0.01
    jdist info                     # versions, devices and topology
    jdist bench --quick            # the benchmark suite (source checkouts)

Bad input ends with one line on stderr, `jdist train: error: ...`, and exit
status 2 (settings) or 1 (data, checkpoints, failures while running); never
a traceback from inside JAX unless `--debug` asks for one.
"""

from __future__ import annotations

import argparse
import dataclasses
from importlib import metadata
import os
import platform
import socket
import subprocess
import sys

import jax

import jdist
from jdist import errors
from jdist.app import config as config_lib
from jdist.app import cpu_devices
from jdist.app.optimizer_spec import OptimizerSpec
from jdist.app.train_loop import TrainError
from jdist.collectives import native
from jdist.compression import sparseloco
from jdist.consistency import ReplicaMismatchError
from jdist.runtime import abort
from jdist.runtime import host
from jdist.runtime import job as job_lib
from jdist.runtime import topology

EXIT_USAGE = 2
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line: `prog: error: message`."""

  def error(self, message: str):
    # Under mpirun every rank parses the same flags: one copy of the message.
    text = f"{self.prog}: error: {message} (see {self.prog} --help)\n"
    self.exit(EXIT_USAGE, text if topology.launcher_rank() == 0 else None)


def build_train_parser(prog: str = "jdist train") -> argparse.ArgumentParser:
  """The parser of `jdist train`'s flags (`--debug` and `--shrink` are not in TrainConfig)."""
  defaults = config_lib.TrainConfig()
  parser = _Parser(prog=prog, allow_abbrev=False,
                   description="Train a model data-parallel on every local device and, "
                   "under mpirun, every process.",
                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  _add_data_flags(parser, defaults)
  _add_optimization_flags(parser, defaults)
  _add_communication_flags(parser, defaults)
  _add_checkpoint_flags(parser, defaults)
  _add_runtime_flags(parser, defaults)
  return parser


def _add_data_flags(parser: argparse.ArgumentParser, defaults: config_lib.TrainConfig) -> None:
  """Adds the "data and model" flags: which model, which dataset, how much of it."""
  group = parser.add_argument_group("data and model")
  group.add_argument("--model", default=defaults.model,
                     help="cnn (SINGA's MNIST CNN), mlp, resnet8/20/32/56 (BatchNorm), "
                     "resnet8_gn ... (GroupNorm)")
  group.add_argument("--dataset", default=defaults.dataset,
                     help="digits (bundled, no download), mnist, fashion_mnist, synthetic")
  group.add_argument("--data-dir", help="directory holding the MNIST-format IDX files")
  group.add_argument("--no-download", dest="download", action="store_false",
                     help="fail instead of downloading a dataset that is not found")
  group.add_argument("--train-limit", type=int, help="use only the first N training examples")
  group.add_argument("--test-limit", type=int, help="use only the first N test examples")


def _add_optimization_flags(parser: argparse.ArgumentParser,
                            defaults: config_lib.TrainConfig) -> None:
  """Adds the "optimization" flags: epochs, batch sizes, the optimizer, the seed."""
  group = parser.add_argument_group("optimization")
  group.add_argument("--epochs", type=int, default=defaults.epochs)
  group.add_argument("--batch-size", type=int, default=defaults.batch_size,
                     help="examples per replica per step (global batch = this x replicas)")
  group.add_argument("--eval-batch-size", type=int, default=defaults.eval_batch_size,
                     help="examples per replica per evaluation step (0: max(batch size, 128))")
  group.add_argument("--optimizer", default=defaults.optimizer,
                     choices=config_lib.OPTIMIZERS)
  group.add_argument("--lr", type=float, default=defaults.lr, help="learning rate")
  group.add_argument("--momentum", type=float, default=defaults.momentum,
                     help="SGD momentum (0 for none), or Adam's b1")
  group.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
  group.add_argument("--seed", type=int, default=defaults.seed,
                     help="seed of the initial parameters and the data order")
  group.add_argument("--max-steps", type=int,
                     help="stop after this many steps in all (with a checkpoint)")


def _add_communication_flags(parser: argparse.ArgumentParser,
                             defaults: config_lib.TrainConfig) -> None:
  """Adds the "communication" group: jdist.dist_opt's modes, then the step guards.

  The modes say how gradients (or parameters) cross replicas; the guards
  cover non-finite steps and replica checks. One group, in this order, as
  `--help` shows it.
  """
  group = parser.add_argument_group("communication (jdist.dist_opt modes)")
  for field in dataclasses.fields(OptimizerSpec):  # schemes whose spec field declares its flag
    if "flag" in field.metadata:
      group.add_argument("--" + field.name.replace("_", "-"), **field.metadata["flag"])
  group.add_argument("--momentum-correction", action="store_true",
                     help="with --sparsify (or --signsgd, where it is the default) and sgd: "
                     "apply the momentum locally before the compression (Deep Gradient "
                     "Compression)")
  _add_periodic_sync_flags(group, defaults)
  _add_step_guard_flags(group, defaults)


def _add_periodic_sync_flags(group: argparse._ArgumentGroup,
                             defaults: config_lib.TrainConfig) -> None:
  """Adds DiLoCo's and post-local SGD's flags to `group`: local steps, then a sync."""
  group.add_argument("--diloco", type=int, metavar="H",
                     help="DiLoCo: H local inner steps, then the averaged pseudo-gradient "
                     "takes an outer SGD step (Nesterov); with --half it travels in 16 bits")
  group.add_argument("--diloco-fragments", type=int, default=defaults.diloco_fragments,
                     metavar="P", help="Streaming DiLoCo: P fragments synced on staggered "
                     "steps, one fragment's bytes per sync")
  group.add_argument("--diloco-outer-lr", type=float, default=defaults.diloco_outer_lr,
                     metavar="LR", help="DiLoCo's outer learning rate (outer SGD with "
                     "Nesterov momentum); default: the paper's 0.7 (with --optimizer sgd and "
                     "--momentum above 0.9: times 10 (1 - momentum))")
  group.add_argument("--diloco-outer-momentum", type=float,
                     default=defaults.diloco_outer_momentum, metavar="MU",
                     help="DiLoCo's outer Nesterov momentum; default: the paper's 0.9 with "
                     "adam/adamw; with --optimizer sgd, whose heavy-ball momentum already "
                     "multiplies its steps by 1/(1 - momentum), what that leaves of the "
                     "paper's 1/(1 - 0.9): 1 - 1/(10 (1 - momentum)), 0 at --momentum 0.9 "
                     "(docs/diloco.md)")
  group.add_argument("--diloco-backoff", action="store_true",
                     help="when the training loss rises across DiLoCo's outer syncs, halve "
                     "the outer learning rate and go on (a warning is printed either way)")
  group.add_argument("--diloco-payload", default=defaults.diloco_payload,
                     metavar="PAYLOAD",
                     help="what DiLoCo's pseudo-gradient travels as, one of "
                     + ", ".join(config_lib.DILOCO_PAYLOADS) + " (default: --half's, else "
                     "float32); int8/int4: levels with a float32 scale per 256 values, with "
                     "error feedback; sparse[:RATIO]: SparseLoCo, the top RATIO (default "
                     f"{sparseloco.DEFAULT_RATIO:g}) of each chunk of 4096 values in 2 bits, "
                     "indices packed, with error feedback")
  group.add_argument("--diloco-delay", type=int, default=defaults.diloco_delay,
                     metavar="TAU", help="apply each fragment's outer step TAU steps after its "
                     "exchange (0 <= TAU < H), which runs in the background meanwhile")
  group.add_argument("--diloco-mix", type=float, default=defaults.diloco_mix, metavar="M",
                     help="on an outer step, keep the share M of the local parameters "
                     "(0 <= M < 1; Streaming DiLoCo uses 0.5 with a delay)")
  group.add_argument("--local-sgd", type=int, metavar="H",
                     help="post-local SGD: local steps, parameters averaged every H steps")
  group.add_argument("--local-sgd-warmup", type=int, default=defaults.local_sgd_warmup,
                     metavar="STEPS", help="fully synchronous steps before --local-sgd starts")


def _add_step_guard_flags(group: argparse._ArgumentGroup,
                          defaults: config_lib.TrainConfig) -> None:
  """Adds the step guards to `group`: non-finite gradients or parameters, replica checks."""
  group.add_argument("--skip-nonfinite", action="store_true",
                     help="every replica skips steps whose gradients hold NaN or Inf")
  group.add_argument("--check-replicas-every", type=int,
                     default=defaults.check_replicas_every, metavar="STEPS",
                     help="check (by checksum) that all replicas hold identical parameters, "
                     "every N steps and at the end (0: never)")
  group.add_argument("--on-nonfinite", default=defaults.on_nonfinite,
                     choices=config_lib.ON_NONFINITE,
                     help="when the parameters hold NaN/Inf (never checkpointed): stop with "
                     "an error, or roll back to the last checkpoint and go on")


def _add_checkpoint_flags(parser: argparse.ArgumentParser,
                          defaults: config_lib.TrainConfig) -> None:
  """Adds the "checkpoints and logs" flags: saving, resuming, the log, evaluation."""
  group = parser.add_argument_group("checkpoints and logs")
  group.add_argument("--checkpoint-dir", help="write checkpoints here (rank 0 writes)")
  group.add_argument("--checkpoint-every", type=int, default=0, metavar="STEPS",
                     help="also checkpoint every N steps (0: at epoch ends only)")
  group.add_argument("--resume", action="store_true",
                     help="continue from the latest checkpoint in --checkpoint-dir")
  group.add_argument("--log-file", help="JSON-lines log: one record per epoch and a summary")
  group.add_argument("--eval-every", type=int, default=defaults.eval_every, metavar="EPOCHS",
                     help="evaluate every N epochs and after the last (0: never)")
  group.add_argument("--local-checkpoint-every", type=int, default=0, metavar="STEPS",
                     help="also save every N steps to a fast per-node local tier (0: never); "
                     "a resume takes the newest intact checkpoint of either tier")
  group.add_argument("--local-checkpoint-dir", metavar="DIR",
                     help="the local tier's directory (default: per node, under /dev/shm or "
                     "the temp dir)")
  group.add_argument("--no-progress", dest="progress", action="store_false",
                     help="no progress bar (per-epoch lines are printed either way)")


def _add_runtime_flags(parser: argparse.ArgumentParser,
                       defaults: config_lib.TrainConfig) -> None:
  """Adds the "runtime" flags: timeout, backend, CPU devices, timeline, `--debug`."""
  group = parser.add_argument_group("runtime")
  group.add_argument("--timeout", type=float, metavar="SECONDS",
                     help="how long a cross-process exchange may wait before the job is "
                     "aborted (default $JDIST_TIMEOUT or 300)")
  group.add_argument("--backend", default=defaults.backend, choices=config_lib.BACKENDS,
                     help="cross-process collectives: mpi4jax (mpi) or JAX's own (jax)")
  group.add_argument("--cpu-devices", type=int, metavar="N",
                     help="for CPU testing: run N host (CPU) devices per process, as "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=N would")
  group.add_argument("--timeline", metavar="FILE",
                     help="write a Chrome/Perfetto trace of every rank's steps and exchanges "
                     "(docs/timeline.md; read it with `jdist timeline summarize FILE`)")
  group.add_argument("--timeline-steps", metavar="A:B",
                     help="with --timeline: record train steps A to B-1 only")
  group.add_argument("--shrink", action="store_true",
                     help="under `jdist launch --shrink`: when processes die, the others "
                     "shrink the job and keep training (Open MPI ULFM; docs/multinode.md)")
  group.add_argument("--debug", action="store_true",
                     help="show the full traceback when the run fails, and every library's "
                          "output while a failed job ends (JDIST_DEBUG=1)")


def parse_train_args(argv, prog: str = "jdist train") -> tuple[config_lib.TrainConfig, bool]:
  """Parses and validates `jdist train` flags.

  Returns:
    (config, debug).

  Raises:
    SystemExit: with status 2 and a one-line message on stderr for any bad
      flag, value or combination (status 0 for --help).
  """
  parser = build_train_parser(prog)
  args = vars(parser.parse_args(argv))
  debug = args.pop("debug")
  args.pop("shrink")  # read by train_main before parsing
  config = config_lib.TrainConfig(**args)
  try:
    config_lib.validate(config)
  except config_lib.ConfigError as err:
    parser.error(str(err))
  return config, debug


def _collective_errors() -> tuple[type, ...]:
  """Errors raised on every process alike: each can exit without aborting the others."""
  return (config_lib.ConfigError, TrainError, errors.CheckpointError,
          errors.StructureMismatchError, errors.WorldMismatchError, ReplicaMismatchError)


def _report_failure(prog: str, err: BaseException) -> int:
  """Prints one error line (rank 0 for collective errors) and ends this process's part."""
  topo = job_lib.current() if job_lib.is_initialized() else None
  text = str(err) or type(err).__name__
  if isinstance(err, _collective_errors()):
    if topo is None or topo.is_primary:
      sys.stderr.write(f"{prog}: error: {text}\n")
    return EXIT_FAILURE
  rank = f" (rank {topo.process_index})" if topo is not None and topo.multi_process else ""
  sys.stderr.write(f"{prog}: error{rank}: {type(err).__name__}: {text}\n"
                   f"{prog}: run with --debug for the traceback.\n")
  sys.stderr.flush()
  host.abort(EXIT_FAILURE)  # the other ranks may be waiting for this one
  return EXIT_FAILURE


def train_main(argv=None, prog: str = "jdist train") -> int:
  """`jdist train`: parse, validate, train; returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  shrink = "--shrink" in argv  # jdist launch --shrink's mode (jdist.app.train_shrink)
  if shrink:
    argv.remove("--shrink")
  config, debug = parse_train_args(argv, prog)
  if debug:  # every library's output too while a failed job ends (jdist.runtime.abort)
    os.environ.setdefault(abort.DEBUG_ENV, "1")
  # Imported here: the trainer loads the models (Flax), which `--help` need not.
  try:
    from jdist.app import train as train_lib  # pylint: disable=g-import-not-at-top
  except ModuleNotFoundError as err:  # tqdm, scikit-learn: the `app` extra
    sys.stderr.write(f"{prog}: error: {err}: install the training application's "
                     f"dependencies with pip install 'jdist[app]'.\n")
    return EXIT_FAILURE
  try:
    if shrink:
      from jdist.app import train_shrink  # pylint: disable=g-import-not-at-top
      train_shrink.leave(train_shrink.train(config))
    else:
      train_lib.train(config)
  except KeyboardInterrupt:
    sys.stderr.write(f"{prog}: interrupted\n")
    return EXIT_INTERRUPTED
  except Exception as err:  # pylint: disable=broad-except
    if debug:
      raise
    return _report_failure(prog, err)
  return 0


def info_main(argv=None) -> int:
  """`jdist info`: versions, devices and the topology of this (mpirun) job."""
  parser = _Parser(prog="jdist info", description=info_main.__doc__)
  parser.add_argument("--cpu-devices", type=int, metavar="N",
                      help="force N host (CPU) devices per process first")
  args = parser.parse_args(argv)
  if args.cpu_devices is not None and args.cpu_devices < 1:
    parser.error(f"--cpu-devices={args.cpu_devices} must be an integer >= 1.")
  try:
    if args.cpu_devices:
      cpu_devices.force_cpu_devices(args.cpu_devices)
    topo = jdist.init()
  except Exception as err:  # pylint: disable=broad-except
    return _report_failure("jdist info", err)
  devices = jax.local_devices()
  mine = (f"process {topo.process_index} on {socket.gethostname()} (pid {os.getpid()}, "
          f"local rank {topo.local_rank}): {len(devices)} x {devices[0].platform} "
          f"[{devices[0].device_kind}]")
  everyone = host.allgather_object(mine, "jdist info")
  if not topo.is_primary:
    return 0
  versions = []
  for package in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "mpi4py",
                  "mpi4jax"):
    try:
      versions.append(f"{package} {metadata.version(package)}")
    except metadata.PackageNotFoundError:
      versions.append(f"{package} (not installed)")
  print(f"jdist {jdist.__version__} (python {platform.python_version()}, "
        f"{platform.system()} {platform.machine()})")
  print("packages: " + ", ".join(versions))
  mpi = host.mpi_description()
  if mpi is not None:
    print(f"MPI: {mpi}")
  print(f"topology: {topo}; timeout {topo.timeout:g} s")
  if native.unavailable_reason():
    print(f"  native exchange unavailable: {native.unavailable_reason()}")
  for line in everyone:
    print(f"  {line}")
  for name in ("XLA_FLAGS", "JAX_PLATFORMS", "NPROC", "JDIST_TIMEOUT", "CUDA_VISIBLE_DEVICES"):
    if os.environ.get(name):
      print(f"  ${name}={os.environ[name]}")
  return 0


def benchmarks_checkout() -> str | None:
  """The source checkout holding `benchmarks/` (the working directory, else the
  directory above this package: an editable install), or None."""
  here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  for root in (os.getcwd(), here):
    if os.path.isfile(os.path.join(root, "benchmarks", "__main__.py")):
      return root
  return None


def bench_main(argv=None) -> int:
  """`jdist bench ARGS`: `python -m benchmarks ARGS` in a source checkout, as a subprocess.

  The benchmarks ship with source checkouts only and jdist never imports them.
  """
  checkout = benchmarks_checkout()
  if checkout is None:
    sys.stderr.write("jdist bench: error: no benchmarks/ here: they ship with the source "
                     "checkout only; run jdist bench (or python -m benchmarks) from the "
                     "repository root.\n")
    return EXIT_FAILURE
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      p for p in (checkout, os.environ.get("PYTHONPATH")) if p))
  return subprocess.call([sys.executable, "-m", "benchmarks", *(argv or [])], cwd=checkout,
                         env=env)


COMMANDS = {"train": "train a model (jdist train --help)",
            "info": "print versions, devices and the topology",
            "bench": "run the benchmark suite (source checkouts)",
            "launch": "run mpirun so that a failed job always ends (jdist launch --help)",
            "timeline": "summarize or plot a --timeline trace (jdist timeline --help)"}


def main(argv=None) -> int:
  """Entry point of the `jdist` console script; returns the exit status."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] == "train":
    return train_main(argv[1:])
  if argv and argv[0] == "info":
    return info_main(argv[1:])
  if argv and argv[0] == "bench":
    return bench_main(argv[1:])
  if argv and argv[0] == "launch":
    from jdist.app import launch  # pylint: disable=g-import-not-at-top
    return launch.main(argv[1:])
  if argv and argv[0] == "timeline":
    from jdist.app import timeline_cli  # pylint: disable=g-import-not-at-top
    return timeline_cli.main(argv[1:])
  parser = _Parser(prog="jdist", description="jdist: data-parallel training for JAX.",
                   epilog="\n".join(f"  {name:6} {text}" for name, text in COMMANDS.items()),
                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("command", choices=tuple(COMMANDS), help="what to do")
  parser.add_argument("--version", action="version", version=_version())
  parser.parse_args(argv[:1] or [])  # help, version, or a one-line error
  return EXIT_USAGE


def _version() -> str:
  try:
    return f"jdist {metadata.version('jdist')}"
  except Exception:  # pylint: disable=broad-except
    return "jdist (version unknown)"


if __name__ == "__main__":
  sys.exit(main())
