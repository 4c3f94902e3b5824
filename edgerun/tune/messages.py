"""The tuning protocol (`edgerun tune`): what a tuning master and its pipeline workers exchange beside the
pipeline's own messages, on the same frames (pp.messages: seal, open_frame). A worker that trains (tune.worker.
TuneRole) answers them; REQUESTS and TRAINING are the workers' and the master's tables."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from edgerun.net.typed import Tensors
from edgerun.net.wire import PpMsg
from edgerun.pp.messages import PIPELINE, table
from edgerun.tune.lora import LoraConfig


@dataclass(frozen=True)
class TuneLoad:
    """master -> worker: train layers first_layer..end_layer-1 of the model file with this sha256 (fetched from the
    master where the worker's cache lacks it), from a checkpoint's matrices and moments where given."""

    KIND: ClassVar[PpMsg] = PpMsg.TUNE_LOAD
    model_sha256: str
    first_layer: int
    end_layer: int
    lora: LoraConfig
    lr: float
    weight_decay: float
    steps: int = 0  # the optimizer steps taken before the checkpoint
    recompute: bool = False  # recompute activations in the backward pass instead of keeping them
    checkpoint: Tensors = field(default_factory=dict)  # this stage's LoRA matrices and moments, by name


@dataclass(frozen=True)
class TuneLoaded:
    KIND: ClassVar[PpMsg] = PpMsg.TUNE_LOADED
    frozen_bytes: int  # the stage's frozen weights
    load_peak_rss_mb: float
    rss_mb: float


@dataclass(frozen=True)
class TuneForward:
    """master -> worker: a micro-batch's input (token ids or a hidden state); the last stage gets the labels and
    the loss's denominator too, and answers with the loss and the input's gradient."""

    KIND: ClassVar[PpMsg] = PpMsg.TUNE_FORWARD
    step: int
    micro: int
    input: np.ndarray
    labels: np.ndarray | None = None
    denominator: int = 0


@dataclass(frozen=True)
class TuneOutput:
    """worker -> master: the output hidden state, or (the last stage) the loss over `count` tokens and the input's
    gradient (none from a first stage that is also the last)."""

    KIND: ClassVar[PpMsg] = PpMsg.TUNE_OUTPUT
    loss: float = 0.0
    count: int = 0
    hidden: np.ndarray | None = None
    grad: np.ndarray | None = None


@dataclass(frozen=True)
class TuneBackward:
    """master -> worker: the gradient of a micro-batch's output; answered by TuneGrad."""

    KIND: ClassVar[PpMsg] = PpMsg.TUNE_BACKWARD
    micro: int
    grad: np.ndarray


@dataclass(frozen=True)
class TuneGrad:
    KIND: ClassVar[PpMsg] = PpMsg.TUNE_GRAD
    grad: np.ndarray | None = None  # the input's gradient (none from the first stage)


@dataclass(frozen=True)
class TuneEval:
    """master -> worker: a forward pass without dropout or gradient; answered by TuneOutput (the loss where labels
    come, else the hidden state)."""

    KIND: ClassVar[PpMsg] = PpMsg.TUNE_EVAL
    input: np.ndarray
    labels: np.ndarray | None = None


@dataclass(frozen=True)
class TuneStep:
    """master -> worker: apply the accumulated gradients (AdamW) at this learning rate."""

    KIND: ClassVar[PpMsg] = PpMsg.TUNE_STEP
    lr: float


@dataclass(frozen=True)
class TuneStepped:
    KIND: ClassVar[PpMsg] = PpMsg.TUNE_STEPPED
    compute_s: float  # forward and backward seconds so far
    peak_rss_mb: float


@dataclass(frozen=True)
class TuneState:
    """master -> worker: the LoRA matrices and optimizer moments, for a checkpoint."""

    KIND: ClassVar[PpMsg] = PpMsg.TUNE_STATE


@dataclass(frozen=True)
class TuneStateData:
    KIND: ClassVar[PpMsg] = PpMsg.TUNE_STATE_DATA
    steps: int
    state: Tensors = field(default_factory=dict)


TuneRequest = TuneLoad | TuneForward | TuneBackward | TuneEval | TuneStep | TuneState  # master -> worker
TuneReply = TuneLoaded | TuneOutput | TuneGrad | TuneStepped | TuneStateData  # worker -> master
REQUESTS = table(*typing.get_args(TuneRequest))  # what a training worker takes beside the pipeline's messages
TRAINING = PIPELINE | table(*typing.get_args(TuneReply))  # what a tuning master takes
