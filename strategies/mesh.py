"""ParallelDims: the degrees of every parallelism, validated, and the DeviceMesh they span.

As in torchtitan's ``distributed/parallel_dims.py``: one dataclass holds the degrees,
validates them in ``__post_init__`` (before any process starts), derives the data-parallel
degree when it is ``"auto"`` (``world_size / (tensor_parallel * pipeline_parallel *
context_parallel)``, as Megatron-LM computes ``data_parallel_size``), and builds one
DeviceMesh whose named dimensions hand out sub-meshes and process groups.

A strategy validates its degrees once, at construction, without a world size (what can
be checked then is), and fills the world size in with :meth:`ParallelDims.with_world_size`
when it is known (before launching, then after the process group starts).

Context parallelism (``context_parallel = cp > 1``) adds a ``"cp"`` dimension between dp and
tp: the ranks of a cp group read the same batches and hold ``1/cp`` of every sequence
(:mod:`plugintrain.model_zoo.context_parallel`). Their gradients are partial sums of one
batch's, so gradients are averaged, and ZeRO / FSDP2 shard, over dp x cp, as torchtitan's
``dp_shard_cp``: :func:`data_parallel_mesh` is that flattened mesh, and :func:`batch_mesh`
the ranks that read different batches.

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
MESH_DIMS = ("pp", "dp", "cp", "tp")
EXPERT_MESH_DIMS = ("pp", "edp", "ep", "cp", "tp")
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
    """Replicas; ``"auto"``: ``world_size / (tensor_parallel * pipeline_parallel * cp)``."""
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
    context_parallel: int = 1
    """Ranks that split every sequence (context parallelism); they read the same batches."""
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
        model_parallel = self.tensor_parallel * self.pipeline_parallel * self.context_parallel
        if self.world_size % model_parallel:
            raise ValueError(
                f"world_size={self.world_size} is not divisible by tensor_parallel="
                f"{self.tensor_parallel} x pipeline_parallel={self.pipeline_parallel} x"
                f" context_parallel={self.context_parallel} = {model_parallel}; change the"
                " number of devices or the degrees."
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
            "context_parallel": self.context_parallel,
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
        product *= self.context_parallel
        if product != self.world_size:
            raise ValueError(
                f"data_parallel={self.data_parallel} x tensor_parallel={self.tensor_parallel}"
                f" x pipeline_parallel={self.pipeline_parallel} x context_parallel="
                f"{self.context_parallel} = {product} != world_size={self.world_size}; set"
                " data_parallel to 'auto' or fix the degrees."
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
    def cp(self) -> int:
        """The context-parallel degree (ranks a sequence is split over)."""
        return self.context_parallel

    @property
    def cp_enabled(self) -> bool:
        """Whether every sequence is split over more than one rank."""
        return self.context_parallel > 1

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
            name = "seq_len / context_parallel" if self.context_parallel > 1 else "seq_len"
            sizes[name] = seq_len // self.context_parallel
        bad = {name: size for name, size in sizes.items() if size % tp}
        if bad:
            raise ValueError(
                f"{config.name}: {bad} not divisible by tensor_parallel={tp}; pick a"
                " tensor_parallel that divides them (or pad the vocabulary)."
            )
        self.validate_experts(config)
        self.validate_context(config, seq_len)

    def validate_context(self, config: ModelShape, seq_len: int | None = None) -> None:
        """Raise if context parallelism cannot split ``seq_len``-token rows of ``config``:
        rows are cut into ``2 cp`` equal chunks (one from each end per rank), and dropout
        would draw other masks on a split sequence than on a whole one."""
        cp = self.context_parallel
        if cp == 1:
            return
        if seq_len is not None and seq_len % (2 * cp):
            fits = [d for d in range(1, seq_len // 2 + 1) if seq_len % (2 * d) == 0][:8]
            raise ValueError(
                f"seq_len={seq_len} is not divisible by 2 x context_parallel={2 * cp} (each"
                f" rank holds two equal chunks, one from each end); pick context_parallel"
                f" among {fits} or a seq_len divisible by {2 * cp}."
            )
        dropout = getattr(config, "dropout", 0.0)
        if dropout:
            raise ValueError(
                f"{config.name}: context_parallel={cp} needs dropout 0 (got {dropout}): a"
                " split sequence would draw other dropout masks; set model.config.dropout: 0."
            )

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
        """The world's DeviceMesh with named dims ``("pp", "dp", "cp", "tp")`` (pp and cp
        only when > 1), or ``("pp", "edp", "ep", "cp", "tp")`` with ``("edp", "ep")``
        flattened into ``"dp"`` when ``expert_parallel > 1``; with cp, the data-parallel dims
        and cp are flattened into ``"dp_cp"`` (:func:`data_parallel_mesh`).

        Needs an initialized default process group of ``world_size`` ranks.
        """
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims(world_size={self.world_size}) but the process group has"
                f" {dist.get_world_size()} ranks."
            )
        ep = self.expert_parallel
        sizes = {"pp": self.pipeline_parallel, "dp": self.dp, "tp": self.tensor_parallel}
        sizes |= {"edp": self.dp // ep, "ep": ep, "cp": self.context_parallel}
        dims = EXPERT_MESH_DIMS if self.ep_enabled else MESH_DIMS
        names = tuple(name for name in dims if name not in ("pp", "cp") or sizes[name] > 1)
        mesh = init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)
        batch_mesh(mesh)
        data_parallel_mesh(mesh)
        expert_data_mesh(mesh)
        return mesh


def batch_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that read different batches: ``mesh["dp"]``, or with expert parallelism
    the ``("edp", "ep")`` dims flattened into one (torch keeps it: a later call returns the
    same mesh and group). Context-parallel peers read the same batches. Use it rather than
    ``mesh["dp"]``, which torch 2.13 still resolves for a flattened dim but warns about."""
    names = mesh.mesh_dim_names or ()
    if "edp" not in names:
        return mesh["dp"]
    return mesh["edp", "ep"]._flatten("dp")


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks over which gradients are averaged and ZeRO / FSDP2 shard: the
    :func:`batch_mesh`, times the cp ranks when there are (flattened into ``"dp_cp"``)."""
    names = mesh.mesh_dim_names or ()
    if "cp" not in names:
        return batch_mesh(mesh)
    return mesh[tuple(n for n in ("dp", "edp", "ep", "cp") if n in names)]._flatten("dp_cp")


def expert_data_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """With expert parallelism, the ranks holding the same experts, over which their
    gradients are reduced: ``mesh["edp"]``, times the cp ranks when there are (flattened
    into ``"edp_cp"``); None without expert parallelism."""
    names = mesh.mesh_dim_names or ()
    if "ep" not in names:
        return None
    if "cp" not in names:
        return mesh["edp"]
    return mesh["edp", "cp"]._flatten("edp_cp")
