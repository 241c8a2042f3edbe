"""ParallelDims: the degrees of every parallelism, validated, and the DeviceMesh they span.

As in torchtitan's ``distributed/parallel_dims.py``: one dataclass holds the degrees,
validates them in ``__post_init__`` (before any process starts), derives the data-parallel
degree when it is ``"auto"`` (``world_size / (tensor_parallel * pipeline_parallel)``, as
Megatron-LM computes ``data_parallel_size``), and builds one DeviceMesh whose named
dimensions hand out sub-meshes and process groups.

A strategy validates its degrees once, at construction, without a world size (what can
be checked then is), and fills the world size in with :meth:`ParallelDims.with_world_size`
when it is known (before launching, then after the process group starts).

Expert parallelism borrows its ranks from data parallelism, as in torchtitan: with
``expert_parallel > 1`` the mesh is ``("pp", "edp", "ep", "tp")``, ``dp = edp x ep``, and
``("edp", "ep")`` is flattened into ``"dp"`` (:func:`data_parallel_mesh`), so everything
that reduces or samples over dp is unchanged. An ``ep`` group holds the experts of a MoE
layer between them; an ``edp`` group is the ranks holding the same experts, over which
their gradients are reduced.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plugintrain.core.contracts import ExpertShape, ModelShape

# Outermost first: pipeline stages talk least, tensor-parallel ranks most, so tp is the
# innermost (fastest-varying, same-node) dimension, as in Megatron-LM and torchtitan.
MESH_DIMS = ("pp", "dp", "tp")
EXPERT_MESH_DIMS = ("pp", "edp", "ep", "tp")
"""With expert parallelism: dp split into the expert-data-parallel and expert-parallel ranks."""
ZERO_STAGES = (0, 1, 2, 3)


@dataclass
class ParallelDims:
    """Degrees of parallelism over ``world_size`` ranks.

    Raises:
        ValueError: On a layout that cannot run, naming the offending values.
    """

    world_size: int | None = None
    """Total number of ranks (``nodes x processes per node``); None until it is known."""
    data_parallel: int | Literal["auto"] = "auto"
    """Replicas; ``"auto"``: ``world_size / (tensor_parallel * pipeline_parallel)``."""
    tensor_parallel: int = 1
    """Ranks that split each layer's weights (Megatron-LM tensor parallelism)."""
    sequence_parallel: bool = False
    """Run norms and dropout on sequence shards (Korthikanti et al. 2022); needs tp > 1."""
    pipeline_parallel: int = 1
    """Pipeline stages."""
    virtual_pipeline_parallel: int = 1
    """Model chunks per pipeline rank (interleaved schedules); > 1 needs pp > 1."""
    expert_parallel: int = 1
    """Ranks that split the experts of MoE layers; borrowed from the data-parallel ranks."""
    zero_stage: int = 0
    """Data-parallel sharding: 0 (DDP), 1 (optimizer state), 2 (+ grads), 3 (+ params, FSDP2)."""

    requested_data_parallel: int | Literal["auto"] = field(init=False, repr=False)
    """``data_parallel`` as given, before ``"auto"`` was resolved."""

    def __post_init__(self) -> None:
        self.requested_data_parallel = self.data_parallel
        self._check_positive()
        self._check_options()
        if self.world_size is None:
            if self.data_parallel != "auto":
                self._check_experts()
            return
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if self.world_size % model_parallel:
            raise ValueError(
                f"world_size={self.world_size} is not divisible by tensor_parallel="
                f"{self.tensor_parallel} x pipeline_parallel={self.pipeline_parallel} ="
                f" {model_parallel}; change the number of devices or the degrees."
            )
        if self.data_parallel == "auto":
            self.data_parallel = self.world_size // model_parallel
        self._check_product()
        self._check_experts()

    def with_world_size(self, world_size: int) -> ParallelDims:
        """These degrees over ``world_size`` ranks, validated (``"auto"`` resolved anew)."""
        return dataclasses.replace(
            self, world_size=world_size, data_parallel=self.requested_data_parallel
        )

    def _check_positive(self) -> None:
        degrees = {
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "virtual_pipeline_parallel": self.virtual_pipeline_parallel,
            "expert_parallel": self.expert_parallel,
        }
        if self.world_size is not None:
            degrees["world_size"] = self.world_size
        if self.data_parallel != "auto":
            degrees["data_parallel"] = self.data_parallel
        bad = {name: v for name, v in degrees.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"Parallel degrees must be integers >= 1, got {bad}.")

    def _check_product(self) -> None:
        product = self.data_parallel * self.tensor_parallel * self.pipeline_parallel
        if product != self.world_size:
            raise ValueError(
                f"data_parallel={self.data_parallel} x tensor_parallel={self.tensor_parallel}"
                f" x pipeline_parallel={self.pipeline_parallel} = {product} != world_size="
                f"{self.world_size}; set data_parallel to 'auto' or fix the degrees."
            )

    def _check_experts(self) -> None:
        dp = self.data_parallel
        if dp % self.expert_parallel:
            fits = [d for d in range(1, dp + 1) if dp % d == 0]
            raise ValueError(
                f"expert_parallel={self.expert_parallel} must divide data_parallel={dp}:"
                f" expert ranks are borrowed from the data-parallel ranks; pick"
                f" expert_parallel among {fits}, or more data-parallel ranks."
            )

    def _check_options(self) -> None:
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError(
                "sequence_parallel=True needs tensor_parallel > 1 (it shards the activations"
                " between the tensor-parallel regions); got tensor_parallel=1."
            )
        if self.virtual_pipeline_parallel > 1 and self.pipeline_parallel == 1:
            raise ValueError(
                f"virtual_pipeline_parallel={self.virtual_pipeline_parallel} needs"
                " pipeline_parallel > 1."
            )
        if isinstance(self.zero_stage, bool) or self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {self.zero_stage!r}.")
        if self.zero_stage == 3 and self.pipeline_parallel > 1:
            raise ValueError(
                f"zero_stage=3 (FSDP2) cannot be combined with pipeline_parallel="
                f"{self.pipeline_parallel} yet; use zero_stage 0, 1 or 2 (ZeRO-1/2 shard the"
                " optimizer state and gradients over the data-parallel ranks)."
            )
        if self.zero_stage == 3 and self.expert_parallel > 1:
            raise ValueError(
                f"zero_stage=3 (FSDP2) cannot be combined with expert_parallel="
                f"{self.expert_parallel} yet; use zero_stage 0, 1 or 2 (ZeRO-1/2 shard the"
                " experts' optimizer state and gradients over the ranks holding each expert)."
            )

    @property
    def tp(self) -> int:
        """The tensor-parallel degree."""
        return self.tensor_parallel

    @property
    def pp(self) -> int:
        """The pipeline-parallel degree (stages)."""
        return self.pipeline_parallel

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline rank."""
        return self.virtual_pipeline_parallel

    @property
    def ep(self) -> int:
        """The expert-parallel degree."""
        return self.expert_parallel

    @property
    def dp(self) -> int:
        """The data-parallel degree (resolved from ``"auto"`` once the world size is known)."""
        if not isinstance(self.data_parallel, int):
            raise RuntimeError("data_parallel='auto' is resolved once the world size is known.")
        return self.data_parallel

    @property
    def tp_enabled(self) -> bool:
        """Whether layers are split over more than one rank."""
        return self.tensor_parallel > 1

    @property
    def dp_enabled(self) -> bool:
        """Whether there is more than one data-parallel replica."""
        return self.dp > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Whether parameters are sharded over the data-parallel ranks (ZeRO-3 via FSDP2)."""
        return self.zero_stage == 3

    @property
    def ep_enabled(self) -> bool:
        """Whether the routed experts of MoE layers are split over more than one rank."""
        return self.expert_parallel > 1

    def validate_model(self, config: ModelShape, seq_len: int | None = None) -> None:
        """Raise if ``config`` (and ``seq_len`` with SP) cannot be split ``tensor_parallel``
        ways, or its experts ``expert_parallel`` ways (:meth:`validate_experts`).

        Args:
            config: The model architecture.
            seq_len: Training sequence length; checked only with sequence parallelism.
        """
        tp = self.tensor_parallel
        sizes = {
            "n_head": config.n_head,
            "n_kv_head": config.kv_heads,
            "ffn_dim (MLP width)": config.ffn_dim,
            "vocab_size": config.vocab_size,
        }
        if self.sequence_parallel and seq_len is not None:
            sizes["seq_len"] = seq_len
        bad = {name: size for name, size in sizes.items() if size % tp}
        if bad:
            raise ValueError(
                f"{config.name}: {bad} not divisible by tensor_parallel={tp}; pick a"
                " tensor_parallel that divides them (or pad the vocabulary)."
            )
        self.validate_experts(config)

    def validate_experts(self, config: ModelShape) -> None:
        """Raise if expert parallelism cannot split ``config``'s experts: ep > 1 on a model
        without mixture-of-experts layers, or a routed expert count ep does not divide."""
        ep, name = self.expert_parallel, config.name
        moe = config.moe if isinstance(config, ExpertShape) else None
        sparse = moe is not None and any(moe.is_moe_layer(i) for i in range(config.n_layer))
        if ep > 1 and not sparse:
            raise ValueError(
                f"{name}: expert_parallel={ep} splits the experts of mixture-of-experts"
                " layers, and this model has none; use expert_parallel=1."
            )
        if not sparse:
            return
        experts = moe.n_routed_experts
        if experts % ep:
            dp = self.data_parallel if isinstance(self.data_parallel, int) else experts
            fits = [d for d in range(1, experts + 1) if experts % d == 0 and dp % d == 0]
            raise ValueError(
                f"{name}: n_routed_experts={experts} not divisible by expert_parallel={ep}"
                f" (each expert-parallel rank holds an equal share); pick expert_parallel"
                f" among {fits}."
            )

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The world's DeviceMesh with named dims ``("pp", "dp", "tp")`` (pp only when > 1),
        or ``("pp", "edp", "ep", "tp")`` with ``("edp", "ep")`` flattened into ``"dp"``
        when ``expert_parallel > 1``.

        Needs an initialized default process group of ``world_size`` ranks.
        """
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims(world_size={self.world_size}) but the process group has"
                f" {dist.get_world_size()} ranks."
            )
        ep = self.expert_parallel
        sizes = {"pp": self.pipeline_parallel, "dp": self.dp, "tp": self.tensor_parallel}
        sizes |= {"edp": self.dp // ep, "ep": ep}
        dims = EXPERT_MESH_DIMS if self.ep_enabled else MESH_DIMS
        names = tuple(name for name in dims if name != "pp" or sizes["pp"] > 1)
        mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
        data_parallel_mesh(mesh)
        return mesh


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh``'s data-parallel dimension: ``mesh["dp"]``, or with expert parallelism the
    ``("edp", "ep")`` dims flattened into one (torch keeps it: a later call returns the same
    mesh and group). Use it rather than ``mesh["dp"]``, which torch 2.13 still resolves for
    a flattened dim but warns about."""
    names = mesh.mesh_dim_names or ()
    if "dp" in names:
        return mesh["dp"]
    return mesh["edp", "ep"]._flatten("dp")
