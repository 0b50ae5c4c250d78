"""Typed configuration schemas, registered in Hydra's ConfigStore.

Every Hydra group (``dataset/ backbone/ method/ partition/ setting/ experiment/``) is backed by a
dataclass here, so a misspelt key or a wrong type fails at start-up and names the key. Library
code receives these dataclasses (never a ``DictConfig``); only the entry points touch Hydra
(:func:`fedadapt.entry.register_configs` registers these schemas). Checks that a type cannot
express (ranges, cross-field rules) live in :func:`validate`, which names the offending key with
its full path.

Methods register their own schema (see :mod:`fedadapt.adapters`), so ``method.hidden_dim`` is
a valid key for ``method=mlp_head`` and an error for ``method=linear_head``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

from omegaconf import MISSING


class FedadaptError(Exception):
    """An expected failure with a message for the user (the CLI prints it as one line)."""


class ConfigError(FedadaptError, ValueError):
    """A configuration value is invalid; the message names the key."""


@dataclass
class DatasetConfig:
    """Which data set to load (the card in ``datasets/<name>.yaml`` says how)."""

    name: str = MISSING
    #: Local copy to load instead of the card's hub id: a ``save_to_disk`` folder, an image
    #: folder (one sub-folder per class) or a folder of IDX files.
    path: Optional[str] = None
    #: Fraction held out as the global test set when the source has no test split; 0 = none
    #: (domain data sets, whose unseen client is the held-out domain).
    test_fraction: float = 0.2
    #: Use only the first N training samples (after a seeded shuffle); None = all.
    max_samples: Optional[int] = None


@dataclass
class BackboneConfig:
    """A frozen feature extractor, built by :func:`fedadapt.backbones.build_backbone`."""

    name: str = MISSING
    #: Factory key: ``vit``, ``deit``, ``clip``, ``efficientnet_lite``, ``small_cnn``.
    family: str = MISSING
    #: Hub id or local path of the weights; None builds the architecture with random weights.
    weights: Optional[str] = None
    image_size: int = 224
    #: Evaluation preprocessing: resize the shortest side to ``image_size / crop_pct``, then
    #: centre-crop ``image_size``; None = the weights' own (an image processor config next to hub
    #: weights, open_clip's preprocess config) or the family's default.
    crop_pct: Optional[float] = None
    #: ``bicubic`` or ``bilinear`` resize filter; None = the weights' own or the family's.
    interpolation: Optional[str] = None
    #: Architecture overrides (e.g. a tiny ViT for tests); the family defines the keys.
    arch: dict[str, Any] = field(default_factory=dict)


@dataclass
class MethodConfig:
    """Base schema of every method; each method subclasses it (see fedadapt.adapters)."""

    name: str = MISSING
    #: This method's own strategy, over the run's ``strategy=`` group: a baseline defined by its
    #: aggregation keeps it in a ``compare`` job (FedCLIP's FedProx baseline: ``{name: fedprox,
    #: proximal_mu: 0.001}``). Applied when the config is composed
    #: (:func:`fedadapt.entry.to_run_config`); null = the run's ``strategy``.
    strategy: Any = None
    #: Moved to the strategy group (``strategy=fedprox strategy.proximal_mu=MU``); refused.
    proximal_mu: Optional[float] = None
    #: How the server weights the clients' tensors: ``examples`` (FedAvg: by training samples)
    #: or ``uniform`` (every client alike, as FedCLIP's authors average the adapter).
    weighting: str = "examples"
    #: Train on cached pooled features (methods that only see the pooled feature).
    use_cache: bool = True
    #: This method's own local training, over the run's ``train.*`` (any ``train`` key, e.g.
    #: ``{optimizer: sgd, lr: 0.01}``): a baseline keeps its paper's optimiser beside the
    #: adapter's in one ``compare`` job. Applied when the config is composed
    #: (:func:`fedadapt.entry.to_run_config`); empty = the run's ``train``.
    train: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """The domains of this method's own keys (a method's schema overrides it; raise
        :class:`ConfigError` naming ``method.<key>``). :func:`validate` calls it, so a bad value
        fails before any data is loaded."""


@dataclass
class StrategyConfig:
    """``strategy=NAME``: one of Flower's strategies (``flwr.serverapp.strategy``) by its Flower
    name; each option's schema adds the class's own constructor parameters as keys
    (:mod:`fedadapt.strategies.registry` reads them from Flower)."""

    name: str = "fedavg"


@dataclass
class StrategyCustomConfig(StrategyConfig):
    """``strategy=custom``: any Flower strategy, named by import path
    (``strategy.target=pkg.module.Class``, or ``path/to/file.py:Class`` relative to the working
    directory or to a ``--config-dir``); every other key of the node is a constructor argument,
    checked against the class's signature (:mod:`fedadapt.strategies.custom`). The typed config
    carries them in :attr:`kwargs`."""

    name: str = "custom"
    target: str = MISSING

    @property
    def kwargs(self) -> dict:
        """The constructor arguments given as keys (``strategy.step=0.5``)."""
        return self.__dict__.get("_kwargs", {})


@dataclass
class DPConfig:
    """``dp=NAME``: one of Flower's differential-privacy wrappers around the strategy
    (``server_fixed``, ``client_fixed``, ``server_adaptive``, ``client_adaptive``), with the
    wrapper's own parameters as keys; ``none``: no wrapper."""

    name: str = "none"


@dataclass
class SecAggConfig:
    """``secagg=NAME``: secure aggregation of the clients' updates. ``none`` (the default):
    the server sees each client's update. ``secaggplus``: Flower's SecAgg+ (its
    ``SecAggPlusWorkflow`` on the server, its ``secaggplus_mod`` on each client; see
    :mod:`fedadapt.federation.server.secagg`): the server learns only the example-weighted mean
    of the updates of the clients that finished, computed from quantised, masked integers. The
    keys are Flower's ``SecAggPlusWorkflow`` parameters."""

    name: str = "none"
    #: Shares each client's secrets are split into: an int > 2, or a float, that share of the
    #: clients sampled in the round (1.0: every other client).
    num_shares: float = 1.0
    #: Shares needed to rebuild a secret: an int < num_shares, or a float, that share of
    #: num_shares. Fewer surviving neighbours than this and the round fails.
    reconstruction_threshold: float = 0.5
    #: Each parameter (times its client's weight, at most 1) is clipped to
    #: [-clipping_range, clipping_range] before it is quantised.
    clipping_range: float = 8.0
    #: Quantisation levels over [-clipping_range, clipping_range] (Flower's default 2**22).
    quantization_range: int = 4194304
    #: The masks' modulus, a power of 2 above quantization_range x the clients sampled.
    modulus_range: int = 4294967296
    #: The largest weight (training examples) a client may send; null: the largest client's
    #: training examples in the partition (every weight ratio then at most 1).
    max_weight: Optional[float] = None
    #: Seconds the server waits at each of the protocol's four stages; null:
    #: ``federation.round_timeout`` (null there: no limit).
    timeout: Optional[float] = None


@dataclass
class PartitionConfig:
    """How the training split is divided into clients (flwr-datasets partitioners).

    ``kind`` picks the partitioner (``conf/partition/<kind>.yaml`` presets each one):
    ``dirichlet`` (``DirichletPartitioner`` over the label, ``alpha``), ``iid``, ``natural`` (one
    client per value of the card's client key, ``NaturalIdPartitioner``; ``ids_per_client`` > 1
    groups them, ``GroupedNaturalIdPartitioner``), ``domain``, ``superclass``, ``shard``
    (``ShardPartitioner``: the data sorted by label, cut into shards, ``shards_per_client``
    shards per client, as FedAvg's pathological non-IID split), ``pathological``
    (``PathologicalPartitioner``: ``classes_per_client`` classes per client), ``inner_dirichlet``
    (``InnerDirichletPartitioner``: client sizes fixed by ``sizes`` or equal, the classes inside
    each client drawn from Dirichlet(``alpha``)), ``size`` (``SizePartitioner``: client i gets
    ``sizes[i]`` samples), ``exponential`` / ``linear`` / ``square`` (client i's size grows as
    exp(i), i or i^2: ``ExponentialPartitioner``, ``LinearPartitioner``, ``SquarePartitioner``).
    The size-based kinds and ``iid`` shuffle the data with the seed first (flwr-datasets cuts
    them in order).
    """

    #: The partitioner (see above).
    kind: str = "dirichlet"
    num_clients: int = 10
    alpha: float = 0.5
    #: Fraction of clients trained per round.
    fraction_fit: float = 0.5
    #: Fraction of clients evaluated on their local test split when evaluation runs.
    fraction_evaluate: float = 1.0
    #: Dirichlet: minimum samples per client (flwr-datasets retries until it holds).
    min_partition_size: int = 10
    #: Per-client split of each partition into train / val / test.
    val_fraction: float = 0.1
    test_fraction: float = 0.2
    #: Domain partition: the domain held out as the unseen client (None = the card's default;
    #: ``none``: every domain is a training client).
    holdout: Optional[str] = None
    #: ``superclass``: the column of the coarse label (each client draws from one superclass,
    #: as ICIIA's ImageNet clients from one parent category) ...
    superclass_key: str = "coarse_label"
    #: ... except this fraction of the clients, which draw from all classes (ICIIA Figure 7:
    #: heterogeneity = 1 - mixed_fraction).
    mixed_fraction: float = 0.0
    #: Fraction of the clients held out whole as unseen test clients (ICIIA's "by client"
    #: split: iNaturalist); their data is all test data. Server-trained methods only.
    test_clients: float = 0.0
    #: shard: shards per client (FedAvg: 2) ...
    shards_per_client: Optional[int] = 2
    #: ... and samples per shard; None = as many as fill ``num_clients x shards_per_client``
    #: shards from the data (give one of the two, or both).
    shard_size: Optional[int] = None
    #: shard: keep the last, incomplete shard (only with ``shards_per_client=null``).
    keep_incomplete_shard: bool = False
    #: pathological: classes per client ...
    classes_per_client: int = 2
    #: ... chosen ``random``-ly, ``deterministic``-ally (client i: classes i, i+1, ...) or
    #: ``first-deterministic`` (the first class deterministic, the others random).
    class_assignment: str = "random"
    #: size: samples per client (one per client; required); inner_dirichlet: the same, or
    #: None for equal shares of the data.
    sizes: Optional[list[int]] = None
    #: natural: natural ids (e.g. writers) grouped into one client; 1 = one id per client.
    ids_per_client: int = 1
    #: Keep only a seeded selection of this many natural ids (the card's client key, e.g.
    #: FEMNIST's writers) and their samples, before partitioning: ``natural`` then makes one
    #: client of each selected id (``num_clients`` must equal it), ``iid`` / ``dirichlet``
    #: spread the selected ids' pooled samples over ``num_clients``, so both partitions hold
    #: the same data (the Accumulator paper's FEMNIST: 381 writers, IID and by writer).
    #: None = every id (``natural`` keeps a seeded ``num_clients`` of them).
    select_ids: Optional[int] = None
    #: Fraction of the training clients held out whole as validation clients (all their data
    #: is validation data: ICIIA's iNaturalist, "we leave out 20% of the users originally for
    #: training now for validation"). Server-trained methods only.
    val_clients: float = 0.0


@dataclass
class SettingConfig:
    """Training/evaluation regime (the Accumulator paper's settings, Sec. 5.1).

    * ``conventional``: train and evaluate the last exit only.
    * ``anytime``: an exit drawn uniformly per training iteration; evaluated at every exit.
    * ``multitier``: each client has a fixed exit (its tier), tiers balanced across clients;
      a client runs only the blocks up to its exit.
    * ``personalization``: multi-tier FL on clean data, then every client fine-tunes the part
      ``personalize`` of the model for ``epochs`` epochs on its own corrupted data (at its
      tier's exit) and keeps it; accuracy on its corrupted test split before and after.
    """

    name: str = "conventional"
    #: multitier / personalization: the exits (0-based blocks) the tiers use, assigned to the
    #: clients in a balanced, seeded way; None = every exit of the backbone.
    tiers: Optional[list[int]] = None
    #: multitier: ``balanced`` (the paper's: tiers in equal seeded shares) or ``fleet`` (each
    #: client the deepest of the tiers its device trains within ``federation.round_timeout``
    #: simulated seconds; needs a ``fleet=``). anytime with ``fleet``: each client's steps draw
    #: from the exits up to the deepest its device trains in time on average.
    tiers_from: str = "balanced"
    #: personalization: ``trainable`` (everything the method trains), ``full`` (also the
    #: backbone), ``adapters`` (the parallel adapters only), ``accumulator`` (the Accumulator
    #: and its head), ``client_token`` or ``tuner`` (a PEFT method's tensors in the backbone:
    #: LoRA's A and B, (IA)^3's vectors, BitFit's biases).
    personalize: str = "trainable"
    #: personalization: local epochs on the corrupted data (paper: 10).
    epochs: int = 10
    #: personalization: learning rate (None = train.lr).
    lr: Optional[float] = None
    #: personalization: the client's split the personalization step fine-tunes on (it is
    #: tested on the client's test split): ``train`` (the data it trained on in FL: FedCLIP's
    #: local fine-tuning) or ``val`` (held out from FL: the Accumulator paper's personal set,
    #: "10,000 images from the original training set", split in two for personalization and
    #: the final test).
    personal_split: str = "train"
    #: personalization: corruption kinds assigned to clients (CIFAR-100-C style), with their
    #: severities (0 = clean); each client gets one (kind, severity), seeded and balanced.
    corruptions: list[str] = field(default_factory=lambda: [
        "gaussian_noise", "shot_noise", "impulse_noise", "gaussian_blur", "contrast",
        "brightness", "pixelate"])
    severities: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4, 5])
    #: personalization: start from this run directory's last checkpoint (a multi-tier run of
    #: the same method) instead of running the FL rounds first.
    init_from: Optional[str] = None

    @property
    def kind(self) -> "SettingKind":
        """What this setting does (:data:`SETTINGS`), which the code asks instead of its name."""
        return SETTINGS[self.name]


@dataclass(frozen=True)
class SettingKind:
    """What a ``setting=`` does: the code reads these, never a setting's name."""

    #: The model's exits are trained and evaluated (a method with early exits is needed).
    exits: bool = False
    #: Each training step draws its exit (anytime).
    exit_per_step: bool = False
    #: Each client has a fixed exit, its tier, and sends only its tier's tensors.
    tiers: bool = False
    #: ``method.ranks`` follow the clients' tiers.
    rank_by_tier: bool = False
    #: ``setting.tiers_from=fleet`` applies (each client's device caps its exits).
    tiers_from_fleet: bool = False
    #: After FL, each client fine-tunes a part of the model on its own data and keeps it.
    personal_phase: bool = False


#: ``setting=`` name -> what it does (:func:`register_setting`).
SETTINGS: dict[str, SettingKind] = {
    "conventional": SettingKind(),
    "anytime": SettingKind(exits=True, exit_per_step=True, tiers_from_fleet=True),
    "multitier": SettingKind(exits=True, tiers=True, rank_by_tier=True, tiers_from_fleet=True),
    "personalization": SettingKind(exits=True, tiers=True, personal_phase=True),
}


def register_setting(name: str, kind: SettingKind) -> None:
    """Offer ``setting=name`` (its keys are :class:`SettingConfig`'s) doing what ``kind`` says."""
    SETTINGS[name] = kind


@dataclass
class TrainConfig:
    """Local training of one client in one round."""

    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    #: Adam / AdamW moments' decay rates and epsilon (FedCLIP: (0.9, 0.98) and 1e-6).
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    batch_size: int = 32
    local_epochs: int = 1
    #: Cosine annealing of the learning rate over rounds (the round is the step).
    cosine: bool = False
    #: RandomResizedCrop area scale ``[min, max]`` for training images (the Accumulator paper:
    #: ``[0.05, 1.0]``); null = no augmentation. Needs image inputs (not cached features).
    crop_scale: Optional[list[float]] = None
    #: ``auto`` (bf16 autocast on CUDA, fp32 on the CPU), ``fp32`` or ``bf16``; trainable
    #: tensors, optimiser state and everything communicated stay fp32 (see fedadapt.devices).
    precision: str = "auto"
    #: torch's deterministic algorithms (and cuBLAS's workspace setting): bit-exact GPU reruns.
    deterministic: bool = False
    #: Clip each client's gradient norm to this value at every step; null = no clipping.
    clip_grad_norm: Optional[float] = None


@dataclass
class FederationConfig:
    """How the simulation runs."""

    #: ``simulation``: Flower's simulation engine (Ray backend, ``flwr.simulation.run_simulation``),
    #: the workers Ray actors. ``inprocess``: the same server code, ClientApp and workers in this
    #: one process, no Ray (one machine; with ``workers=auto`` a model trained whole on the CPU
    #: gets a worker per free core, training at once on threads, else the workers take turns):
    #: the same numbers, less start-up and memory (docs/speed.md). ``auto``: in process when
    #: this machine's CPU serves the run with one planned worker, Flower's simulation engine for
    #: several workers, a GPU or a Ray cluster (the run's layout line says which).
    backend: str = "auto"
    #: Simulated workers (Ray actors that each hold the frozen backbone once and train the
    #: clients a message names): ``auto`` = one per GPU, on the CPU one per two cores; or N.
    workers: str = "auto"
    #: Clients a worker trains side by side (``auto``: what fits the GPU's measured memory; on
    #: the CPU up to 1,024 images a step); 1 = one after another. See
    #: fedadapt.federation.simulation.sizing.
    clients_per_worker: str = "auto"
    #: Capture the step of clients side by side with ``torch.compile`` (fixed shapes: every
    #: client's last batch padded; on a GPU ``mode="reduce-overhead"``, CUDA graphs): ``auto``
    #: = on a GPU, not on the CPU (each new shape compiles for tens of seconds there);
    #: ``true``; ``false``. See fedadapt.federation.client.grouped.
    compile: str = "auto"
    #: CPUs per worker; None = the machine's CPUs split over the workers, each worker's torch
    #: threads capped by the cores other processes leave free (fedadapt.cores; the layout line
    #: says how many). A number fixes them whatever the load.
    num_cpus: Optional[float] = None
    #: GPUs per Ray worker (fractional); 0 = CPU only, CUDA is never touched; None = use a GPU
    #: when one is visible (the share then follows from the backbone's measured memory).
    num_gpus: Optional[float] = None
    #: Evaluate every k rounds (and always at the last round).
    eval_every: int = 1
    #: Seconds to wait for client replies in a round; None = no limit. Late clients are dropped
    #: from the round. In simulation a worker's clients train one group after another, so a
    #: client is late when its reply exists (plus any injected delay) after the timeout.
    round_timeout: Optional[float] = None
    #: The run stops when fewer than this fraction of a round's sampled clients reply usably
    #: (with a fleet: of those the simulated fleet did not drop, late or offline).
    min_reply_fraction: float = 0.5
    #: Write a checkpoint every k rounds (and always after the last); 0 = only after the last.
    checkpoint_every: int = 5
    #: Show Flower's own INFO logs.
    verbose: bool = False
    #: Flower ClientApp mods (``module:function``, e.g. ``flwr.clientapp.mod:arrays_size_mod``)
    #: applied to each client's training / evaluation reply, inside the worker that trains it
    #: (``dp=client_*`` adds Flower's clipping mod itself).
    train_mods: list[Any] = field(default_factory=list)
    evaluate_mods: list[Any] = field(default_factory=list)
    #: A server-side evaluation with Flower's signature, ``evaluate_fn(server_round, arrays) ->
    #: MetricRecord | None`` (``pkg.module.fn`` or ``file.py:fn``), called after every evaluated
    #: round (and before round 1 with ``eval_round0``); its metrics go into ``metrics.jsonl`` as
    #: ``evaluate_fn/<key>``. It adds to fedadapt's own global evaluation, or replaces it with
    #: ``global_eval=false`` (its ``accuracy`` and ``loss`` then fill the tables' global columns).
    evaluate_fn: Optional[str] = None
    #: fedadapt's own evaluation of the global model on the global test split.
    global_eval: bool = True
    #: Evaluate the initial global model before round 1 (a ``round: 0`` row; as Flower's
    #: ``Strategy.start`` does with an ``evaluate_fn``).
    eval_round0: bool = False
    #: The Ray cluster the simulated clients run on (see fedadapt.federation.simulation.cluster):
    #: null = a private local Ray instance for this run (ignores ``$RAY_ADDRESS`` and clusters left
    #: by ``ray start``); ``HOST:PORT`` = a running cluster's GCS address (what ``ray start
    #: --head`` prints); ``auto`` = Ray's own discovery (``$RAY_ADDRESS``, else the last ``ray
    #: start`` on this machine). An address where no cluster answers fails within seconds.
    ray_address: Optional[str] = None
    #: CPUs / GPUs of the private local instance (``ray.init``); null = all that Ray detects
    #: (CPUs inside a Slurm job: ``$SLURM_CPUS_PER_TASK``).
    #: With ``ray_address`` they must stay null: each node's ``ray start`` sets its resources.
    ray_num_cpus: Optional[int] = None
    ray_num_gpus: Optional[int] = None
    #: Object store of the private local instance, in bytes (Ray's minimum: 78643200);
    #: null = Ray's default (30% of the memory).
    ray_object_store_memory: Optional[int] = None
    #: Which evaluated round the summary reports: ``last``, or ``best_val`` (the round with the
    #: best mean validation accuracy of the clients, as FedCLIP's authors select; clients then
    #: also evaluate their validation split).
    select: str = "last"


@dataclass
class FaultConfig:
    """Fault injection: a seeded random ``fraction`` of the clients misbehave in each round."""

    fraction: float = 0.0
    #: Any of ``raise``, ``nan``, ``wrong_keys``, ``wrong_shape``, ``timeout`` (the client
    #: replies 2 s after ``federation.round_timeout``: the round ends at the timeout without
    #: it), ``straggler`` (the client replies ``delay_s`` late; in time if that is within the
    #: round's timeout).
    kinds: list[str] = field(default_factory=lambda: ["raise", "nan", "wrong_keys",
                                                      "wrong_shape"])
    #: How many seconds a ``straggler`` client's reply is late.
    delay_s: Optional[float] = None


@dataclass
class FleetConfig:
    """Simulated devices (``fleet=`` group): the base of every fleet kind, and itself the kind
    ``none`` (the default: no devices, no clock; nothing changes). The kinds that simulate
    devices and a clock (``tiers``, ``lognormal``, ``trace``, ``fedscale``) and their keys are
    registered by :mod:`fedadapt.federation.simulation.fleet.kinds`. A kind says what it can do
    by its class attributes (not config keys) and refuses its bad values in :meth:`check`."""

    #: ``none``, ``tiers``, ``lognormal``, ``trace`` or ``fedscale``: the ``fleet=`` option.
    name: str = "none"
    #: Whether the kind simulates devices on a clock (False only for ``none``).
    simulated: ClassVar[bool] = False
    #: Whether its devices are FedScale's traces: speeds per sample, turned into FLOP/s by the
    #: model's own training step (the reference FLOPs), read as ``fleet.fedscale_semantics``
    #: says.
    fedscale_traces: ClassVar[bool] = False
    #: Whether it reads the clients' availability from a CSV (``fleet.trace``).
    availability_csv: ClassVar[bool] = False

    @property
    def exact(self) -> bool:
        """Whether it runs FedScale's simulator to the letter
        (``fleet.fedscale_semantics=exact``)."""
        return False

    def check(self, cfg: RunConfig) -> None:
        """Refuse this kind's values that a type cannot (``none`` has none), naming the key."""



@dataclass
class PflConfig:
    """Personalized FL (``pfl=`` group): the base of every personalization kind, and itself the
    kind ``none`` (the default: FedAvg's local training; nothing stays on a client but what the
    method keeps there). The kinds (``fedper``, ``lg_fedavg``, ``fedrep``, ``fedbabu``,
    ``ditto``, ``apfl``) and their keys are registered by :mod:`fedadapt.pfl`; each says which
    of the model's trainable parts stay on the client by :attr:`keeps` (a class attribute,
    not a config key), trains a client's round by its own rule and refuses its bad values in
    :meth:`check`, before any data is read."""

    #: ``none``, or a registered kind: the ``pfl=`` option.
    name: str = "none"
    #: FedBN's idea on a frozen backbone (Li et al., ICLR 2021): the backbone's normalisation
    #: layers' affine parameters (LayerNorm / BatchNorm weight and bias) train and stay on the
    #: client, beside whatever the method trains; any method and kind can add it.
    norms: bool = False
    #: Which trainable part stays on the client: ``""`` (none), ``head`` (the classifier:
    #: FedPer, FedRep, FedBABU) or ``body`` (everything trained in front of it: LG-FedAvg).
    keeps: ClassVar[str] = ""

    def check(self, cfg: RunConfig) -> None:
        """Refuse this kind's values that a type cannot, naming the key (``none``: its
        ``norms`` with a method that trains the backbone whole)."""
        if self.norms:
            check(not getattr(cfg.method, "train_backbone", False), "pfl.norms", self.norms,
                  "the method trains the whole backbone (its norms among it): nothing to keep "
                  "personal beside it")
            check(not cfg.method.use_cache, "pfl.norms", self.norms,
                  "the norms are the backbone's, and this method trains on its cached features: "
                  "add method.use_cache=false")


@dataclass
class TrackingConfig:
    """Experiment tracking, fed by the per-round hook (optional extras ``fedadapt[tracking]``
    and ``fedadapt[wandb]``; see :mod:`fedadapt.tracking`). All off by default; all work
    offline."""

    #: TensorBoard event files under ``<run dir>/tensorboard`` (per-round scalars, the config).
    tensorboard: bool = False
    #: One MLflow run per run directory (the same scalars, the config as params, the run
    #: directory's files as artifacts).
    mlflow: bool = False
    #: MLflow tracking URI; None = the local store ``sqlite:///<output_dir>/mlflow.db``.
    mlflow_uri: Optional[str] = None
    #: MLflow experiment; None = the config's ``experiment``.
    mlflow_experiment: Optional[str] = None
    #: One Weights & Biases run per run directory (the same scalars, the config, the run's
    #: table and curves, the run directory's files), W&B's files under ``<output_dir>/wandb``.
    wandb: bool = False
    #: ``offline`` (nothing leaves the machine; ``wandb sync`` uploads later) or ``online``.
    wandb_mode: str = "offline"
    #: W&B project; None = the config's ``experiment``.
    wandb_project: Optional[str] = None
    #: W&B entity (user or team); None = W&B's default for the logged-in user.
    wandb_entity: Optional[str] = None


@dataclass
class ServerTrainConfig:
    """How a model trained on the server is trained: the original model (``original.*``) and
    the modules of the server-trained methods (ICIIA, DUET, CDC-MMPG: ``method.*``), each with
    its paper's values (:func:`check_server_train` checks them)."""

    #: The learning rate (SGD's for the original model and ICIIA, AdamW's for DUET and CDC-MMPG).
    lr: float = 0.01
    #: SGD's momentum (DUET and CDC-MMPG train with AdamW: only 0).
    momentum: float = 0.0
    #: L2 weight decay (AdamW's decoupled decay for DUET and CDC-MMPG).
    weight_decay: float = 0.0
    #: Up to ``max_epochs``, stopped after ``patience`` epochs without a better validation
    #: score; the best epoch's weights are kept.
    max_epochs: int = 100
    patience: int = 10


@dataclass
class OriginalConfig(ServerTrainConfig):
    """The *original model* of the server-trained methods (ICIIA, DUET, CDC-MMPG): the backbone's
    classifier they start from and are compared with, trained on the server from the training
    clients' pooled data (never the validation or test clients'), by
    :mod:`fedadapt.federation.server.original` and
    :func:`fedadapt.methods.plugin.train.train_original`.

    ``train_backbone=false`` (the offline stand-ins): a linear classifier on the frozen
    backbone's cached features (the method's ``classifier_epochs`` / lr). ``true`` (the papers'
    original model: ICIIA's LEAF CNN trained from scratch on FEMNIST, EfficientNet-B0 fine-tuned
    from ImageNet on iNaturalist): first the backbone and its classifier are trained together
    on the pooled images, SGD with early stopping on the clients' validation data; the trained
    backbone is saved under ``<cache_dir>/original/`` (keyed by backbone, data, clients, these
    settings and the seed, so every method of a job reuses it), its features are cached and
    serve every method, and its classifier is the original model.
    """

    train_backbone: bool = False
    #: SGD: ``lr`` is the classifier's learning rate, the backbone's is ``lr *
    #: backbone_lr_scale`` (ICIIA's authors fine-tune a pretrained EfficientNet at a tenth of
    #: the head's).
    backbone_lr_scale: float = 1.0
    weight_decay: float = 5e-4
    batch_size: int = 32
    #: The learning rates are multiplied by ``lr_decay`` every ``decay_every`` epochs.
    lr_decay: float = 1.0
    decay_every: int = 1


@dataclass
class RunConfig:
    """The root of the composed configuration."""

    dataset: DatasetConfig = MISSING
    backbone: BackboneConfig = MISSING
    method: MethodConfig = MISSING
    #: The Flower strategy (``strategy=`` group) and its DP wrapper (``dp=`` group).
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    dp: DPConfig = field(default_factory=DPConfig)
    #: Secure aggregation of the clients' updates (``secagg=`` group).
    secagg: SecAggConfig = field(default_factory=SecAggConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    setting: SettingConfig = field(default_factory=SettingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    #: Simulated devices and a simulated clock (``fleet=`` group).
    fleet: FleetConfig = field(default_factory=FleetConfig)
    #: Personalized FL: what stays on each client and how it trains (``pfl=`` group).
    pfl: PflConfig = field(default_factory=PflConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    #: What the ``fedadapt`` task function returns to a Hydra sweeper that searches
    #: (``hydra/sweeper=optuna``, preset ``search=lr``): ``val_acc``, the clients' mean accuracy
    #: on their validation splits at the reported round (never the test split); None = nothing.
    #: Needs one method trained by the clients in rounds, and ``partition.val_fraction > 0``.
    objective: Optional[str] = None
    #: The server-trained methods' original model (ICIIA, DUET, CDC-MMPG).
    original: OriginalConfig = field(default_factory=OriginalConfig)
    #: Continue the run (or compare job) in this directory from its last checkpoint.
    resume: Optional[str] = None
    #: Name of the experiment (set by ``conf/experiment/*.yaml``).
    experiment: str = "custom"
    #: Methods compared in one job, each in its own run directory; empty = just ``method``.
    compare: list[str] = field(default_factory=list)
    seed: int = 0
    rounds: int = 20
    #: Root folder for run directories.
    output_dir: str = "outputs"
    #: Where prepared data sets and the feature cache live.
    cache_dir: str = "${oc.env:FEDADAPT_CACHE,${oc.env:HOME}/.cache/fedadapt}"


KNOWN_PARTITIONS = ("dirichlet", "iid", "natural", "domain", "superclass", "shard",
                    "pathological", "inner_dirichlet", "size", "exponential", "linear", "square")
#: ``partition.class_assignment`` (flwr-datasets' PathologicalPartitioner modes).
CLASS_ASSIGNMENTS = ("random", "deterministic", "first-deterministic")
#: ``objective``: what the task function can return to a searching sweeper.
OBJECTIVES = ("val_acc",)
PERSONALIZE_PARTS = ("trainable", "full", "adapters", "accumulator", "client_token", "tuner")
KNOWN_OPTIMIZERS = ("sgd", "adam", "adamw")
KNOWN_WEIGHTINGS = ("examples", "uniform")
KNOWN_SELECTIONS = ("last", "best_val")
#: ``federation.backend``: Flower's simulation engine on Ray, or every worker in this process.
BACKENDS = ("auto", "simulation", "inprocess")
#: ``federation.compile``: capture the grouped step (auto: on a GPU).
COMPILE_CHOICES = ("auto", "true", "false")
#: ``train.precision`` (see :mod:`fedadapt.devices`).
PRECISIONS = ("auto", "fp32", "bf16")
#: ``faults.kinds`` (see :mod:`fedadapt.federation.server.faults`).
FAULT_KINDS = ("raise", "nan", "wrong_keys", "wrong_shape", "timeout", "straggler")


def check(ok: bool, key: str, value: Any, rule: str) -> None:
    """Raise :class:`ConfigError` ``"<key>=<value> is invalid: <rule>"`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {rule}")


#: Ray's smallest object store (``ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES``).
RAY_MIN_OBJECT_STORE = 75 * 1024 * 1024


def _validate_ray(f: FederationConfig) -> None:
    """The ``federation.ray_*`` keys: local resources only for a private instance."""
    check(f.ray_num_cpus is None or f.ray_num_cpus >= 1, "federation.ray_num_cpus",
          f.ray_num_cpus, "must be >= 1 or null")
    check(f.ray_num_gpus is None or f.ray_num_gpus >= 0, "federation.ray_num_gpus",
          f.ray_num_gpus, "must be >= 0 or null")
    check(f.ray_object_store_memory is None or f.ray_object_store_memory
          >= RAY_MIN_OBJECT_STORE, "federation.ray_object_store_memory",
          f.ray_object_store_memory, f"bytes, at least {RAY_MIN_OBJECT_STORE} (75 MiB), or null")
    check(f.ray_address is None or f.ray_address.strip() != "", "federation.ray_address",
          f.ray_address, "HOST:PORT, 'auto', or null for a private local instance")
    if f.ray_address not in (None, "local"):
        for key in ("ray_num_cpus", "ray_num_gpus", "ray_object_store_memory"):
            check(getattr(f, key) is None, f"federation.{key}", getattr(f, key),
                  f"must be null with federation.ray_address={f.ray_address!r}: a running "
                  f"cluster's resources are set by each node's `ray start`")


#: The checks of the kinds registered above this module (``strategy=``: its capabilities
#: against the rest of the config), each run by :func:`validate` (:func:`register_kind_check`).
_KIND_CHECKS: dict[str, Callable[["RunConfig"], None]] = {}


def register_kind_check(group: str, fn: Callable[["RunConfig"], None]) -> None:
    """Have :func:`validate` run ``fn(cfg)`` for the config group ``group`` (its kinds' own
    refusals, registered by the module that registers the kinds)."""
    _KIND_CHECKS[group] = fn


def validate(cfg: RunConfig) -> RunConfig:
    """Check values a type cannot express; raise :class:`ConfigError` naming the key."""
    check(cfg.rounds >= 1, "rounds", cfg.rounds, "must be >= 1")
    _validate_partition(cfg.partition, cfg.dataset)
    _validate_setting(cfg.setting, cfg.partition)
    _validate_train(cfg.train)
    _validate_federation(cfg.federation, cfg.method)
    _validate_original(cfg.original)
    _validate_faults(cfg.faults, cfg.federation)
    cfg.fleet.check(cfg)
    cfg.pfl.check(cfg)
    _validate_secagg(cfg)
    check(cfg.tracking.wandb_mode in ("offline", "online"), "tracking.wandb_mode",
          cfg.tracking.wandb_mode, "one of ('offline', 'online')")
    check(cfg.setting.tiers_from != "fleet" or (cfg.fleet.simulated
                                               and cfg.federation.round_timeout is not None),
          "setting.tiers_from", cfg.setting.tiers_from,
          "'fleet' needs a fleet (fleet=tiers|lognormal|trace|fedscale) and its deadline "
          "(federation.round_timeout, in simulated seconds)")
    check(cfg.backbone.image_size >= 8, "backbone.image_size", cfg.backbone.image_size,
          "must be >= 8")
    _check_domains(cfg)
    cfg.method.check()
    _validate_partitioners(cfg.partition)
    _validate_objective(cfg)
    check_numbers(cfg)  # a key's own rule, where it has one, is the one a value meets
    for check_kind in _KIND_CHECKS.values():
        check_kind(cfg)
    return cfg


def _validate_partition(p: PartitionConfig, dataset: DatasetConfig) -> None:
    check(p.kind in KNOWN_PARTITIONS, "partition.kind", p.kind, f"one of {KNOWN_PARTITIONS}")
    check(p.num_clients >= 1, "partition.num_clients", p.num_clients, "must be >= 1")
    check(
        math.isfinite(p.alpha) and p.alpha > 0,
        "partition.alpha",
        p.alpha,
        "the Dirichlet concentration must be > 0 (small = non-IID, e.g. 0.1; large = IID, "
        "e.g. 1000)",
    )
    check(0 < p.fraction_fit <= 1, "partition.fraction_fit", p.fraction_fit, "must be in (0, 1]")
    check(
        0 <= p.fraction_evaluate <= 1,
        "partition.fraction_evaluate",
        p.fraction_evaluate,
        "must be in [0, 1]",
    )
    check(0 <= p.mixed_fraction <= 1, "partition.mixed_fraction", p.mixed_fraction,
           "must be in [0, 1]")
    check(0 <= p.test_clients < 1, "partition.test_clients", p.test_clients,
           "must be in [0, 1)")
    check(p.select_ids is None or p.select_ids >= 1, "partition.select_ids", p.select_ids,
          "must be >= 1 or null")
    check(p.select_ids is None or p.kind != "natural" or p.num_clients == p.select_ids,
          "partition.num_clients", p.num_clients,
          f"partition=natural with partition.select_ids={p.select_ids} makes one client per "
          f"selected id: set both to the same number")
    check(0 <= p.val_clients < 1, "partition.val_clients", p.val_clients, "must be in [0, 1)")
    check(p.min_partition_size >= 1, "partition.min_partition_size", p.min_partition_size,
           "must be >= 1")
    for key, val in (("partition.val_fraction", p.val_fraction),
                     ("partition.test_fraction", p.test_fraction)):
        check(0 <= val < 1, key, val, "must be in [0, 1)")
    check(p.val_fraction + p.test_fraction < 1, "partition.val_fraction",
           p.val_fraction, "val_fraction + test_fraction must leave training data (< 1)")
    check(0 <= dataset.test_fraction < 1, "dataset.test_fraction",
           dataset.test_fraction, "must be in [0, 1)")
    check(dataset.max_samples is None or dataset.max_samples > 0,
           "dataset.max_samples", dataset.max_samples, "must be > 0 or null")


def _validate_setting(st: SettingConfig, p: PartitionConfig) -> None:
    check(st.name in SETTINGS, "setting", st.name, f"one of {tuple(SETTINGS)}")
    check(st.tiers is None or (len(st.tiers) > 0 and min(st.tiers) >= 0), "setting.tiers",
           st.tiers, "a non-empty list of exits >= 0, or null for every exit")
    check(st.personalize in PERSONALIZE_PARTS, "setting.personalize", st.personalize,
           f"one of {PERSONALIZE_PARTS}")
    check(st.epochs >= 1, "setting.epochs", st.epochs, "must be >= 1")
    check(st.lr is None or (st.lr > 0 and math.isfinite(st.lr)), "setting.lr", st.lr,
           "must be > 0 or null")
    check(st.personal_split in ("train", "val"), "setting.personal_split", st.personal_split,
          "'train' or 'val'")
    check(not (st.kind.personal_phase and st.personal_split == "val"
               and p.val_fraction == 0), "setting.personal_split", st.personal_split,
          "'val' fine-tunes on the clients' validation split: it needs partition.val_fraction "
          "> 0")
    check(st.tiers_from in ("balanced", "fleet"), "setting.tiers_from", st.tiers_from,
          "'balanced' or 'fleet'")
    check(st.tiers_from == "balanced" or st.kind.tiers_from_fleet,
          "setting.tiers_from", st.tiers_from,
          "'fleet' assigns the tiers of setting=multitier or caps the exits of setting=anytime")
    check(len(st.corruptions) > 0, "setting.corruptions", st.corruptions, "must not be empty")
    check(len(st.severities) > 0 and all(0 <= s <= 5 for s in st.severities),
           "setting.severities", st.severities, "a non-empty list of severities in 0..5")


def _validate_train(t: TrainConfig) -> None:
    check(t.optimizer in KNOWN_OPTIMIZERS, "train.optimizer", t.optimizer,
           f"one of {KNOWN_OPTIMIZERS}")
    check(t.lr > 0 and math.isfinite(t.lr), "train.lr", t.lr, "must be > 0")
    check(t.batch_size >= 1, "train.batch_size", t.batch_size, "must be >= 1")
    check(t.local_epochs >= 1, "train.local_epochs", t.local_epochs, "must be >= 1")
    check(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be >= 0")
    check(0 <= t.momentum < 1, "train.momentum", t.momentum, "must be in [0, 1)")
    check(len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas), "train.betas", list(t.betas),
           "[beta1, beta2], each in [0, 1)")
    check(t.eps > 0, "train.eps", t.eps, "must be > 0")
    check(t.precision in PRECISIONS, "train.precision", t.precision, f"one of {PRECISIONS}")
    check(t.clip_grad_norm is None or (t.clip_grad_norm > 0 and math.isfinite(t.clip_grad_norm)),
          "train.clip_grad_norm", t.clip_grad_norm, "must be > 0 or null")
    check(t.crop_scale is None or (len(t.crop_scale) == 2
                                    and 0 < t.crop_scale[0] <= t.crop_scale[1] <= 1),
           "train.crop_scale", t.crop_scale, "[min, max] with 0 < min <= max <= 1, or null")


def _validate_federation(f: FederationConfig, method: MethodConfig) -> None:
    from fedadapt.cores import fixed_free_cores

    try:  # the environment's say on the threads (fedadapt.cores), before anything is written
        fixed_free_cores()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check(method.strategy is None or isinstance(method.strategy, dict), "method.strategy",
          method.strategy, "the strategy is a group of its own: strategy=NAME with its keys "
          "(strategy=fedprox strategy.proximal_mu=0.01); a method preset pins one as "
          "method.strategy={name: fedprox, proximal_mu: 0.01}")
    check(method.proximal_mu is None, "method.proximal_mu", method.proximal_mu,
          "FedProx's mu is the strategy's key: strategy=fedprox strategy.proximal_mu=MU")
    check(method.weighting in KNOWN_WEIGHTINGS, "method.weighting", method.weighting,
           f"one of {KNOWN_WEIGHTINGS}")
    check(f.select in KNOWN_SELECTIONS, "federation.select", f.select,
           f"one of {KNOWN_SELECTIONS}")
    check(f.backend in BACKENDS, "federation.backend", f.backend,
           f"one of {BACKENDS} (for a SuperLink use `flwr run`: docs/deployment.md)")
    check(f.backend != "inprocess" or f.ray_address is None, "federation.ray_address",
          f.ray_address, "a Ray cluster needs federation.backend=simulation (inprocess runs "
          "every worker in this process)")
    check(f.num_cpus is None or f.num_cpus > 0, "federation.num_cpus", f.num_cpus,
          "must be > 0 or null")
    check(str(f.compile).strip().lower() in COMPILE_CHOICES, "federation.compile", f.compile,
          f"one of {COMPILE_CHOICES}")
    for key, value in (("federation.workers", f.workers),
                       ("federation.clients_per_worker", f.clients_per_worker)):
        text = str(value).strip().lower()
        check(text == "auto" or (text.isdigit() and int(text) >= 1), key, value,
              "'auto' or an integer >= 1")
    check(f.num_gpus is None or f.num_gpus >= 0, "federation.num_gpus", f.num_gpus,
           "must be >= 0 or null")
    check(f.eval_every >= 1, "federation.eval_every", f.eval_every, "must be >= 1")
    _validate_ray(f)
    check(f.round_timeout is None or f.round_timeout > 0, "federation.round_timeout",
           f.round_timeout, "must be > 0 or null")
    check(0 < f.min_reply_fraction <= 1, "federation.min_reply_fraction",
           f.min_reply_fraction, "must be in (0, 1]")
    check(f.checkpoint_every >= 0, "federation.checkpoint_every", f.checkpoint_every,
           "must be >= 0")


def check_server_train(t: ServerTrainConfig, prefix: str) -> None:
    """The domains of the server training keys, named ``<prefix>.<key>``."""
    check(math.isfinite(t.lr) and t.lr > 0, f"{prefix}.lr", t.lr, "must be > 0")
    check(0 <= t.momentum < 1, f"{prefix}.momentum", t.momentum, "must be in [0, 1)")
    check(math.isfinite(t.weight_decay) and t.weight_decay >= 0, f"{prefix}.weight_decay",
          t.weight_decay, "must be >= 0")
    for key in ("max_epochs", "patience"):
        check(getattr(t, key) >= 1, f"{prefix}.{key}", getattr(t, key), "must be >= 1")


def _validate_original(o: OriginalConfig) -> None:
    check_server_train(o, "original")
    for key in ("backbone_lr_scale", "lr_decay"):
        value = getattr(o, key)
        check(math.isfinite(value) and value >= 0, f"original.{key}", value, "must be >= 0")
    for key in ("batch_size", "decay_every"):
        check(getattr(o, key) >= 1, f"original.{key}", getattr(o, key), "must be >= 1")


def _validate_faults(fl: FaultConfig, f: FederationConfig) -> None:
    check(0 <= fl.fraction < 1, "faults.fraction", fl.fraction, "must be in [0, 1)")
    check(set(fl.kinds) <= set(FAULT_KINDS), "faults.kinds", list(fl.kinds),
           f"each one of {FAULT_KINDS}")
    check(not (fl.fraction > 0 and "timeout" in fl.kinds and f.round_timeout is None),
           "faults.kinds", list(fl.kinds),
           "a 'timeout' fault needs federation.round_timeout to be set")
    check(not (fl.fraction > 0 and "straggler" in fl.kinds and not fl.delay_s),
           "faults.delay_s", fl.delay_s,
           "a 'straggler' fault needs faults.delay_s > 0 (how many seconds late it replies)")


#: Seeds feed numpy's SeedSequence and torch.manual_seed, which take unsigned 64-bit values.
MAX_SEED = 2**63 - 1


#: ``secagg=``: none, or Flower's SecAgg+.
SECAGG_CHOICES = ("none", "secaggplus")


def make_secagg_workflow(sa: "SecAggConfig", *, max_weight: float,
                         timeout: Optional[float] = None):
    """Flower's ``SecAggPlusWorkflow`` with ``secagg.*``; Flower's own checks of the values
    raise :class:`ConfigError` naming the key."""
    from flwr.server.workflow import SecAggPlusWorkflow

    def number(value: float):  # an integral value is Flower's int (a count), else a share
        return int(value) if float(value).is_integer() and value > 1 else float(value)

    try:
        return SecAggPlusWorkflow(number(sa.num_shares), number(sa.reconstruction_threshold),
                                  max_weight=float(max_weight),
                                  clipping_range=float(sa.clipping_range),
                                  quantization_range=int(sa.quantization_range),
                                  modulus_range=int(sa.modulus_range), timeout=timeout)
    except (TypeError, ValueError) as err:
        named = re.search(r"`(\w+)`", str(err))
        key = named.group(1) if named and hasattr(sa, named.group(1)) else "num_shares"
        value = getattr(sa, key)
        raise ConfigError(f"secagg.{key}={value!r} is invalid: {err} (Flower's "
                          f"SecAggPlusWorkflow)") from None


def _validate_secagg(cfg: RunConfig) -> None:
    """``secagg=secaggplus``: Flower's workflow's own checks of its parameters (named by key),
    then what it cannot compose with: it hands the weighted sum of the clients' parameters to
    Flower's FedAvg, so nothing that needs each client's update (a DP wrapper, the server's
    screening of faulty replies, a fleet's per-client clock; the strategy's own check refuses
    a strategy that needs more than the weighted sum)."""
    sa = cfg.secagg
    check(sa.name in SECAGG_CHOICES, "secagg", sa.name, f"one of {SECAGG_CHOICES}")
    if sa.name == "none":
        return
    make_secagg_workflow(sa, max_weight=1.0)  # Flower's checks, as ConfigError naming the key
    count = float(sa.num_shares).is_integer() and sa.num_shares > 1
    check(not count or int(sa.num_shares) % 2 == 1, "secagg.num_shares", sa.num_shares,
          "an integer count of shares must be odd: Flower's SecAggPlusWorkflow tells the "
          "clients an even count and then gives each one more neighbour, and every client "
          "fails at its share-keys stage (IndexError); use an odd count, e.g. "
          f"{int(sa.num_shares) + 1}" if count else "")
    check(sa.max_weight is None or sa.max_weight > 0, "secagg.max_weight", sa.max_weight,
          "must be > 0 or null (the largest client's training examples)")
    check(sa.timeout is None or sa.timeout > 0, "secagg.timeout", sa.timeout,
          "must be > 0 or null (federation.round_timeout)")
    check(cfg.dp.name == "none", "dp", cfg.dp.name,
          "secagg=secaggplus runs Flower's legacy SecAggPlusWorkflow, which fedadapt's DP "
          "wrappers (Message-API strategies) cannot wrap: use dp=none")
    check(cfg.method.weighting == "examples", "method.weighting", cfg.method.weighting,
          "secagg=secaggplus weights each client by its training examples (SecAgg+'s masked "
          "weight): use method.weighting=examples")
    check(cfg.faults.fraction == 0, "faults.fraction", cfg.faults.fraction,
          "secagg=secaggplus hides each client's update, so the server cannot screen a faulty "
          "one (NaN, wrong shapes): use faults.fraction=0")
    check(not cfg.fleet.simulated, "fleet", cfg.fleet.name,
          "secagg=secaggplus runs its four stages on the nodes themselves, not on a simulated "
          "fleet's clock: use fleet=none")
    check(not cfg.setting.kind.tiers, "setting", cfg.setting.name,
          "secagg=secaggplus sums one vector of the same tensors from every client; each tier "
          "sends its own tensors in this setting")


def _check_domains(cfg: RunConfig) -> None:
    """The numeric keys :func:`validate`'s first checks leave open (finiteness, upper bounds)."""
    check(0 <= cfg.seed <= MAX_SEED, "seed", cfg.seed,
          f"must be in 0..{MAX_SEED} (numpy and torch seeds are unsigned)")
    b, t, f, fl = cfg.backbone, cfg.train, cfg.federation, cfg.faults
    check(b.crop_pct is None or 0 < b.crop_pct <= 1, "backbone.crop_pct", b.crop_pct,
          "must be in (0, 1] (the centre crop's share of the resized image) or null")
    for key, val in (("train.eps", t.eps), ("train.weight_decay", t.weight_decay),
                     ("federation.num_cpus", f.num_cpus)):
        check(val is None or math.isfinite(val), key, val, "must be finite")
    check(f.num_gpus is None or math.isfinite(f.num_gpus), "federation.num_gpus", f.num_gpus,
          "must be finite or null")
    check(f.round_timeout is None or math.isfinite(f.round_timeout), "federation.round_timeout",
          f.round_timeout, "must be a finite number of seconds, or null for no limit")
    check(fl.delay_s is None or (math.isfinite(fl.delay_s) and fl.delay_s >= 0),
          "faults.delay_s", fl.delay_s, "must be >= 0 seconds or null")


def _numbers(obj: Any, prefix: str):
    """``(key, value)`` of every number (and list of numbers) in a config dataclass, nested
    dataclasses included (free-form dicts such as ``backbone.arch`` are left to their owner)."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            yield from _numbers(value, key + ".")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield key, value, [value]
        elif isinstance(value, (list, tuple)) and value and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            yield key, list(value), list(value)


def check_numbers(cfg: RunConfig) -> None:
    """Every numeric key of the config, the method's own included, is a finite number >= 0
    (no key of fedadapt takes a negative, NaN or infinite value); stricter domains are checked
    key by key in :func:`validate` and :meth:`MethodConfig.check`, before this."""
    for key, shown, values in _numbers(cfg, ""):
        check(all(math.isfinite(v) and v >= 0 for v in values), key, shown,
              "must be a finite number >= 0")


def _validate_objective(cfg: RunConfig) -> None:
    check(cfg.objective is None or cfg.objective in OBJECTIVES, "objective", cfg.objective,
          f"one of {OBJECTIVES} or null")
    check(cfg.objective is None or cfg.partition.val_fraction > 0, "objective", cfg.objective,
          "a validation objective needs validation data: partition.val_fraction > 0")


def _validate_partitioners(p: PartitionConfig) -> None:
    """The keys of the shard, pathological and size-based partitioners."""
    check(p.shards_per_client is None or p.shards_per_client >= 1, "partition.shards_per_client",
          p.shards_per_client, "must be >= 1 or null")
    check(p.shard_size is None or p.shard_size >= 1, "partition.shard_size", p.shard_size,
          "must be >= 1 or null")
    check(p.kind != "shard" or p.shards_per_client is not None or p.shard_size is not None,
          "partition.shard_size", p.shard_size,
          "partition=shard needs partition.shards_per_client or partition.shard_size")
    check(p.classes_per_client >= 1, "partition.classes_per_client", p.classes_per_client,
          "must be >= 1")
    check(p.class_assignment in CLASS_ASSIGNMENTS, "partition.class_assignment",
          p.class_assignment, f"one of {CLASS_ASSIGNMENTS}")
    check(p.ids_per_client >= 1, "partition.ids_per_client", p.ids_per_client, "must be >= 1")
    check(p.kind != "size" or p.sizes is not None, "partition.sizes", p.sizes,
          "partition=size needs the samples of each client: partition.sizes=[n0,n1,...]")
    if p.sizes is not None and p.kind in ("size", "inner_dirichlet"):
        check(len(p.sizes) == p.num_clients and all(n >= 1 for n in p.sizes), "partition.sizes",
              list(p.sizes), f"one size >= 1 per client ({p.num_clients} = "
                             f"partition.num_clients)")
