"""PyTorch DDP trained like jdist in the time-to-accuracy section (only this and `torch_peer`
import torch).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from benchmarks.harness import torch_peer
from benchmarks.sections import accuracy

POST_LOCAL = "ddp_postlocal"
# PyTorch's post-local SGD run like jdist's local SGD mode of the same name.
POST_LOCAL_MODE = "local_sgd32"

EVAL_CHUNK = 1000
# SingaCNN's layers that hold parameters, by their flax names.
LAYERS = {"Conv_0": "features.0", "Conv_1": "features.3", "Dense_0": "classifier.1",
          "Dense_1": "classifier.3"}


def nchw(images: np.ndarray) -> np.ndarray:
  """NHWC images (jdist's datasets) as the NCHW array torch's convolutions take."""
  return np.ascontiguousarray(np.asarray(images, np.float32).transpose(0, 3, 1, 2))


def torch_state(params: Any, feature_shape: Sequence[int]) -> dict[str, torch.Tensor]:
  """SingaCNN's state dict holding the flax CNN's `params` (`feature_shape`: the last pooled
  map's (channels, height, width)).
  """
  channels, height, width = feature_shape
  state = {}
  for flax_name, torch_name in LAYERS.items():
    kernel = np.asarray(params[flax_name]["kernel"], np.float32)
    if kernel.ndim == 4:  # HWIO -> OIHW
      weight = kernel.transpose(3, 2, 0, 1)
    elif flax_name == "Dense_0":  # rows (h, w, c) -> columns (c, h, w)
      weight = kernel.reshape(height, width, channels, -1).transpose(3, 2, 0, 1)
      weight = weight.reshape(kernel.shape[1], -1)
    else:
      weight = kernel.T
    state[f"{torch_name}.weight"] = torch.from_numpy(np.ascontiguousarray(weight))
    state[f"{torch_name}.bias"] = torch.from_numpy(
        np.asarray(params[flax_name]["bias"], np.float32).copy())
  return state


def singa_cnn_from_flax(flax_model, params: Any, input_shape: Sequence[int]) -> nn.Module:
  """`torch_peer.SingaCNN` shaped as `flax_model` and holding its `params`."""
  net = torch_peer.SingaCNN(num_classes=flax_model.num_classes)
  if flax_model.padding == "SAME":  # 5x5 kernels, stride 1: two pixels each side
    for index in (0, 3):
      net.features[index].padding = (2, 2)
  height, width, channels = input_shape
  with torch.no_grad():
    feature_shape = net.features(torch.zeros(1, channels, height, width)).shape[1:]
  flat = int(np.prod(feature_shape))
  if net.classifier[1].in_features != flat:  # inputs other than 28x28
    net.classifier[1] = nn.Linear(flat, net.classifier[1].out_features)
  net.load_state_dict(torch_state(params, tuple(feature_shape)))
  return net


def post_local_sgd(net: nn.Module, optimizer: torch.optim.Optimizer, *, period: int,
                   warmup_steps: int):
  """`(net in DDP with PyTorch's post-local SGD, the optimizer that averages)`: gradients
  all-reduced for `warmup_steps` steps, then the parameters averaged every `period` steps.
  """
  # pylint: disable=import-outside-toplevel
  from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook
  from torch.distributed.algorithms.model_averaging import averagers
  from torch.distributed.optim import PostLocalSGDOptimizer
  from torch.nn.parallel import DistributedDataParallel
  ddp = DistributedDataParallel(net)
  state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=None,
                                               start_localSGD_iter=warmup_steps,
                                               post_local_gradient_allreduce=False)
  ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
  averager = averagers.PeriodicModelAverager(period=period, warmup_steps=warmup_steps)
  return ddp, PostLocalSGDOptimizer(optim=optimizer, averager=averager)


class TorchTrainer:
  """One torch variant's run from the flax CNN's `params`."""

  framework = "torch"

  def __init__(self, variant: str, flax_model, params: Any, data, replicas: Sequence[int]):
    self.net = singa_cnn_from_flax(flax_model, params, data.train_x.shape[1:])
    sgd = torch.optim.SGD(self.net.parameters(), lr=accuracy.LEARNING_RATE,
                          momentum=accuracy.MOMENTUM)
    self.test_net = self.net  # the model `evaluate` tests
    self.average_net = None
    if variant == POST_LOCAL:
      self.average_net = singa_cnn_from_flax(flax_model, params, data.train_x.shape[1:])
      mode = accuracy.MODES[POST_LOCAL_MODE]
      self.model, self.optimizer = post_local_sgd(
          self.net, sgd, period=mode["local_sgd"], warmup_steps=mode["local_sgd_warmup"])
    else:
      self.model, self.optimizer = torch_peer.wrap(variant, self.net), sgd
    self.loss_fn = nn.CrossEntropyLoss()
    self.replicas = list(replicas)
    self.train_x, self.train_y = nchw(data.train_x), data.train_y.astype(np.int64)
    self.test_x, self.test_y = nchw(data.test_x), data.test_y.astype(np.int64)

  def step(self, indices: np.ndarray) -> float:
    """One SGD step on this rank's rows of `indices` ([replicas, batch]); its loss."""
    rows = indices[self.replicas].reshape(-1)
    self.optimizer.zero_grad(set_to_none=True)
    loss = self.loss_fn(self.model(torch.from_numpy(self.train_x[rows])),
                        torch.from_numpy(self.train_y[rows]))
    loss.backward()  # DDP: returns once every bucket's all-reduce is done
    self.optimizer.step()
    return float(loss.detach())

  def evaluate(self) -> float:
    """Test accuracy of the bare model (no DDP forward: no collective, one rank may call)."""
    hits = 0
    with torch.no_grad():
      for start in range(0, len(self.test_y), EVAL_CHUNK):
        logits = self.test_net(torch.from_numpy(self.test_x[start:start + EVAL_CHUNK]))
        hits += int((logits.argmax(1) == torch.from_numpy(
            self.test_y[start:start + EVAL_CHUNK])).sum())
    return hits / len(self.test_y)

  def sync(self) -> None:
    """Post-local SGD's ranks differ between averagings: tests their average (collective)."""
    if self.average_net is None:
      return
    world = torch.distributed.get_world_size()
    with torch.no_grad():
      for mine, average in zip(self.net.parameters(), self.average_net.parameters()):
        average.copy_(mine)
        torch.distributed.all_reduce(average)
        average /= world
    self.test_net = self.average_net

  def wire_bytes(self) -> None:
    """DDP does not report what it sends (the report shows a dash)."""
    return None

  def details(self) -> dict[str, Any]:
    return {"threads": torch.get_num_threads(), "torch": torch.__version__}
