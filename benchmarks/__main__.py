"""The one entry point of the benchmarks: `python -m benchmarks SECTION [--on WHERE] [options]`.

    python -m benchmarks list                      # the sections and where each runs
    python -m benchmarks [suite] [--quick]         # the suite
    python -m benchmarks SECTION --help            # a section's options
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from benchmarks import registry

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _section_parser(section: registry.Section, place: str | None) -> argparse.ArgumentParser:
  run = section.run(place)
  module = run.load()
  parser = argparse.ArgumentParser(
      prog=f"python -m benchmarks {section.name}", description=module.__doc__.replace("%", "%%"),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--on", choices=tuple(section.runs), default=place or next(iter(section.runs)),
                      help=f"where it runs (default {next(iter(section.runs))}): "
                      "see `python -m benchmarks list`")
  if run.out is not None:
    parser.add_argument("--out", help=f"output directory (default {run.out}"
                        + ("; --quick: a temporary directory" if run.quick else "") + ")")
  if run.quick:
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, minutes")
  if hasattr(module, "add_arguments"):
    module.add_arguments(parser)
  return parser


def _place(section: registry.Section, argv: list[str]) -> str | None:
  """The `--on` value in `argv` (its run decides the options), None when absent or invalid."""
  for index, arg in enumerate(argv):
    value = argv[index + 1] if arg == "--on" and index + 1 < len(argv) else (
        arg.partition("=")[2] if arg.startswith("--on=") else None)
    if value is not None:
      return value if value in section.runs else None
  return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """Parses `SECTION [options]` into a namespace with `section`, `on` and the options."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
    argv.insert(0, "suite")  # the bare form runs the suite
  if argv[0] in ("-h", "--help"):
    print(__doc__ + "\nSections:\n" + registry.table())
    raise SystemExit(0)
  try:
    section = registry.section(argv[0])
  except registry.UsageError as err:
    print(f"python -m benchmarks: error: {err}", file=sys.stderr)
    raise SystemExit(2) from err
  missing = section.missing_extra()
  if missing:
    print(f"python -m benchmarks: error: {missing}", file=sys.stderr)
    raise SystemExit(2)
  parser = _section_parser(section, _place(section, argv[1:]))
  args = parser.parse_args(argv[1:])
  args.section = section.name
  args.command = " ".join(["python -m benchmarks"] + argv)
  run = section.run(args.on)
  if run.out is not None and args.out is None:
    if getattr(args, "render", None):  # rewrite a report beside its JSON
      args.out = os.path.dirname(os.path.abspath(args.render))
    elif getattr(args, "quick", False):
      args.out = os.path.join(tempfile.gettempdir(), f"jdist-{section.name}-{args.on}-quick")
    else:
      args.out = os.path.join(REPO, run.out)
  module = run.load()
  try:
    if hasattr(module, "check"):
      module.check(args)
  except registry.UsageError as err:
    parser.error(str(err))
  return args


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["list"]:
    print(registry.table())
    return 0
  args = parse_args(argv)
  return registry.section(args.section).run(args.on).load().main(args) or 0


if __name__ == "__main__":
  sys.exit(main())
