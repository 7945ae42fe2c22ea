"""PNG figures of the summaries (matplotlib's Agg backend, imported at the first figure)."""

from __future__ import annotations

import os

from benchmarks.harness import analysis


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _save(fig, out_dir: str, name: str) -> str:
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=110)
  _pyplot().close(fig)
  return name


def allreduce_bandwidth(summary: dict, out_dir: str) -> str | None:
  """Bandwidth against size, one panel per job (topology and backend)."""
  rows = summary["allreduce"]
  jobs = list(dict.fromkeys(r["job"] for r in rows))
  if not rows:
    return None
  fig, axes = _pyplot().subplots(1, len(jobs), figsize=(5 * len(jobs), 4.5), sharey=True,
                           squeeze=False)
  for ax, job in zip(axes[0], jobs):
    mine = [r for r in rows if r["job"] == job]
    for variant in dict.fromkeys(r["variant"] for r in mine):
      points = sorted((r for r in mine if r["variant"] == variant), key=lambda r: r["bytes"])
      bandwidth = [r["busbw_GBps"] if r["busbw_GBps"] is not None else r["algbw_GBps"]
                   for r in points]
      ax.plot([r["bytes"] for r in points], bandwidth,
              "--" if variant in ("mpi",) + analysis.NO_EXCHANGE else "-", marker="o", markersize=3,
              label=f"{variant} ({points[0]['route']})")
    ax.set(xscale="log", yscale="log", xlabel="bytes per replica (float32)",
           title=f"{job} ({mine[0]['backend']} backend)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
  axes[0][0].set_ylabel("bus bandwidth, GB/s (memcpy, jdist_noop: bytes/s)")
  return _save(fig, out_dir, "allreduce_bandwidth")


def compression(summary: dict, out_dir: str) -> str | None:
  rows = [r for r in summary["compression"] if r["mode"] != "compute"]
  models = list(dict.fromkeys(r["model"] for r in rows))
  if not rows:
    return None
  fig, axes = _pyplot().subplots(1, 2, figsize=(11, 4.5))
  width = 0.8 / len(models)
  for i, model in enumerate(models):
    mine = [r for r in rows if r["model"] == model]
    positions = [j + i * width for j in range(len(mine))]
    axes[0].bar(positions, [r["wire_bytes"] / 2**20 for r in mine], width, label=model)
    axes[1].bar(positions, [r["comm_s"] * 1e3 for r in mine], width, label=model)
    for ax in axes:
      ax.set_xticks([j + 0.4 - width / 2 for j in range(len(mine))],
                    [r["mode"] for r in mine], rotation=30)
  axes[0].set(ylabel="MB sent per step and process", yscale="log", title="Bytes on the wire")
  axes[1].set(ylabel="ms (step - compute-only step)", yscale="log",
              title="Communication time (compression work included)")
  for ax in axes:
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
  return _save(fig, out_dir, "compression")


def scaling(summary: dict, out_dir: str) -> str | None:
  rows = summary["scaling"]
  if not rows:
    return None
  fig, ax = _pyplot().subplots(figsize=(6, 4))
  ax.bar([r["job"] for r in rows], [r["samples_per_s"] for r in rows])
  for i, r in enumerate(rows):
    if r["efficiency"] is not None:
      ax.annotate(f"{r['efficiency']:.2f}", (i, r["samples_per_s"]), ha="center",
                  va="bottom", fontsize=8)
  ax.set(xlabel="processes x devices", ylabel="samples/s",
         title=f"Weak scaling, {rows[0]['model']} (labels: efficiency vs 1x1)")
  ax.grid(True, axis="y", alpha=0.3)
  return _save(fig, out_dir, "scaling")


def draw_all(summary: dict, out_dir: str) -> list[str]:
  """Writes every figure that has data; returns their names."""
  names = [draw(summary, out_dir) for draw in (allreduce_bandwidth, compression, scaling)]
  return [name for name in names if name]


def network(summary: dict, out_dir: str) -> str | None:
  """Step and communication time against link rate, one line per mode and peer."""
  rows = [r for r in summary["rows"] if r["variant"] not in ("compute", "torch_compute")]
  if not rows:
    return None
  from benchmarks.harness import netns  # pylint: disable=import-outside-toplevel
  links = [l.name for l in reversed(netns.LINKS) if any(r["link"] == l.name for r in rows)]
  topologies = sorted({r["topology"] for r in rows})
  fig, axes = _pyplot().subplots(2, len(topologies), figsize=(6.5 * len(topologies), 8.5),
                           squeeze=False, sharex=True)
  colors = _pyplot().get_cmap("tab20").colors  # more variants than the default 10 colours
  for column, topology in enumerate(topologies):
    for ax in axes[:, column]:
      ax.set_prop_cycle(color=colors)
    mine = [r for r in rows if r["topology"] == topology]
    for variant in dict.fromkeys(r["variant"] for r in mine):
      points = {r["link"]: r for r in mine if r["variant"] == variant}
      xs = [i for i, link in enumerate(links) if link in points]
      kind = next(iter(points.values())).get("kind")
      style = {"torch": "--", "floor": ":", "handwritten": "-."}.get(kind, "-")
      for row_index, key in ((0, "step_s"), (1, "comm_s")):
        if kind == "floor" and key == "step_s":
          continue
        ys = [points[links[i]][key] * 1e3 for i in xs]
        axes[row_index][column].plot(xs, ys, style, marker="o", markersize=3, label=variant)
    axes[0][column].set(title=f"{topology}: median step", ylabel="ms", yscale="log")
    axes[1][column].set(title=f"{topology}: communication (step - compute-only)",
                        ylabel="ms", yscale="symlog", xlabel="link")
    for ax in axes[:, column]:
      ax.set_xticks(range(len(links)), links)
      ax.grid(True, which="both", alpha=0.3)
      ax.legend(fontsize=7, ncol=2)
  return _save(fig, out_dir, "network")
