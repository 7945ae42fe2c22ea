"""What a resumed run may change: the settings compared with the checkpoint's.

`jdist train --resume` continues the run a checkpoint belongs to. Settings
that shape the trained state or the data order must be the checkpoint's;
others may change, with a note that the run then differs from an
uninterrupted one. The optimizer's lists come from its spec
(`jdist.app.optimizer_spec`).
"""

from __future__ import annotations

from typing import Any

from jdist.app import optimizer_spec
from jdist.app.config import TrainConfig
from jdist.app.config import flag
from jdist.app.datasets import normalize_name

# Settings that shape the trained state or the data order: a resumed run must
# use the checkpoint's values, or it would not continue the same run.
RESUME_MUST_MATCH = (("model", "dataset", "batch_size", "train_limit", "seed")
                     + optimizer_spec.MUST_MATCH_ON_RESUME)
# Settings that may change on resume but make it differ from an uninterrupted run.
RESUME_MAY_DIFFER = optimizer_spec.MAY_DIFFER_ON_RESUME


def resume_conflicts(saved: dict[str, Any], config: TrainConfig) -> tuple[list[str], list[str]]:
  """Compares a checkpoint's stored config with this run's.

  Args:
    saved: the config stored with the checkpoint (`TrainConfig.to_dict()`).
    config: this run's settings.

  Returns:
    (errors, notes): settings that must match but differ, and settings that
    differ harmlessly but make the run differ from an uninterrupted one;
    each a "name (--flag): checkpoint X, this run Y" string.
  """
  def differ(names):
    out = []
    for name in names:
      # A setting newer than the checkpoint had its default then.
      old, new = saved.get(name, getattr(TrainConfig(), name)), getattr(config, name)
      if name == "dataset" and old is not None:
        old, new = normalize_name(old), normalize_name(new)
      if old != new:
        out.append(f"{flag(name)}: checkpoint {old!r}, this run {new!r}")
    return out
  return differ(RESUME_MUST_MATCH), differ(RESUME_MAY_DIFFER)
