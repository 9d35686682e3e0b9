"""The rank grid: world = data x pipeline x context x tensor, with sharded-DP partition groups
inside data.

Why it is built this way: docs/design/notes/distribute.md (tfbig.distribute.mesh).
"""
import dataclasses
import os

AXES = {"D": "data", "P": "pipeline", "C": "context", "T": "tensor"}
AXIS_NAMES = ("data", "pipeline", "context", "tensor")
PLACEMENTS = {"cluster": "DPT", "spread": "TPD"}
# What horovodrun (Gloo), Open MPI and MPICH/Slurm PMI set for every process before hvd.init.
WORLD_SIZE_VARIABLES = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def launcher_world_size():
    """The number of processes the launcher started (1 when not started by one).

    Process sets are declared at hvd.init, so the mesh is built before Horovod can say.
    """
    for name in WORLD_SIZE_VARIABLES:
        if os.environ.get(name):
            return int(os.environ[name])
    return 1


def launcher_rank():
    """This process's rank among the launcher's (0 when not started by one), before hvd.init."""
    for name in RANK_VARIABLES:
        if os.environ.get(name):
            return int(os.environ[name])
    return 0


def placement_order(placement):
    """--placement value -> axis order ('cluster', 'spread' or a permutation of 'DPT')."""
    order = PLACEMENTS.get(placement, placement.upper() if placement else "")
    if sorted(order) != sorted("DPT"):
        raise ValueError(f"--placement={placement!r}: expected cluster, spread or an order of "
                         f"the letters D, P, T such as DPT (the last letter varies fastest)")
    return order


@dataclasses.dataclass(frozen=True)
class Mesh:
    """A data x pipeline x context x tensor grid of `data * pipeline * context * tensor` ranks.

    Attributes:
      data, pipeline, tensor, context: the size of each axis.
      shard_degree: data ranks per ZeRO/MiCS partition group (`data`: the whole data axis,
        as ZeRO/FSDP; fewer: MiCS partition groups replicated across the rest). Divides `data`.
      order: axis letters, last varying fastest (see the module docstring).
      expert: data ranks per expert-parallel group (--expert_parallel: consecutive data ranks
        that split the MoE layers' experts between them); divides `data`.
    """

    data: int = 1
    pipeline: int = 1
    tensor: int = 1
    shard_degree: int = 1
    order: str = "DPT"
    context: int = 1
    expert: int = 1

    @classmethod
    def build(cls, world_size, tensor=1, pipeline=1, shard_degree=0, placement="cluster",
              context=1, expert=1):
        """The grid for `world_size` ranks; the data axis takes what the others leave.

        shard_degree 0 means the whole data axis (plain ZeRO); errors name the flags.
        """
        for name, value in (("--tensor_parallel", tensor), ("--pipeline_stages", pipeline),
                            ("--context_parallel", context)):
            if value < 1:
                raise ValueError(f"{name}={value}: expected a positive number of ranks")
        model = tensor * pipeline * context
        if world_size % model:
            axes = " x ".join(f"{name}={value}" for name, value in (
                ("--pipeline_stages", pipeline), ("--context_parallel", context),
                ("--tensor_parallel", tensor)) if value > 1 or name != "--context_parallel")
            raise ValueError(
                f"the world of {world_size} ranks is not data x pipeline x context x tensor: "
                f"{axes} = {model} does not divide {world_size}; start a multiple of {model} "
                f"processes")
        data = world_size // model
        shard_degree = shard_degree or data
        if shard_degree < 1 or data % shard_degree:
            raise ValueError(
                f"--shard_degree={shard_degree} does not divide the {data} data-parallel ranks "
                f"(world {world_size} / (pipeline {pipeline} x tensor {tensor})); choose a "
                f"divisor of {data}")
        if expert < 1 or data % expert:
            raise ValueError(
                f"--expert_parallel={expert} does not divide the {data} data-parallel ranks "
                f"(the experts are split inside the data axis); choose a divisor of {data} "
                f"or start a multiple of {expert} processes")
        return cls(data, pipeline, tensor, shard_degree, placement_order(placement), context,
                   expert)

    @property
    def size(self):
        return self.data * self.pipeline * self.context * self.tensor

    def _sizes(self):
        return {"data": self.data, "pipeline": self.pipeline, "context": self.context,
                "tensor": self.tensor}

    @property
    def _axis_order(self):
        """`order` with the context axis just outside tensor (see the module docstring)."""
        return self.order.replace("T", "CT")

    def coords(self, rank):
        """{'data': d, 'pipeline': p, 'context': c, 'tensor': t} of global rank `rank`."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside the mesh of {self.size} ranks")
        sizes, out = self._sizes(), {}
        for letter in reversed(self._axis_order):  # the last letter varies fastest
            axis = AXES[letter]
            rank, out[axis] = divmod(rank, sizes[axis])
        return {axis: out[axis] for axis in AXIS_NAMES}

    def rank_of(self, data=0, pipeline=0, tensor=0, context=0):
        """The global rank at these coordinates."""
        coords, sizes, rank = {"data": data, "pipeline": pipeline, "tensor": tensor,
                               "context": context}, self._sizes(), 0
        for letter in self._axis_order:
            axis = AXES[letter]
            rank = rank * sizes[axis] + coords[axis]
        return rank

    def group(self, axis, rank):
        """The ranks that differ from `rank` only along `axis`, in axis order.

        axis: 'data', 'pipeline', 'context', 'tensor', or the sharded-DP groups 'partition'
        (the shard_degree ranks sharing one sharded copy of the state), 'replica' (the ranks
        holding the same shard in each partition group) and 'model' (pipeline x tensor: the
        ranks holding one copy of the model between them, sorted; global norms sum over it),
        and the expert-parallel groups 'expert' (the `expert` consecutive data ranks that hold
        one copy of the experts between them) and 'expert_replica' (the ranks holding the
        same experts, one in each expert group).
        """
        c = self.coords(rank)
        if axis == "model":
            return tuple(sorted(self.rank_of(c["data"], p, t, c["context"])
                                for p in range(self.pipeline) for t in range(self.tensor)))
        if axis in ("partition", "replica", "expert", "expert_replica"):
            size = self.expert if axis.startswith("expert") else self.shard_degree
            first, position = divmod(c["data"], size)
            indices = (range(first * size, (first + 1) * size)
                       if axis in ("partition", "expert") else range(position, self.data, size))
            return tuple(self.rank_of(**{**c, "data": d}) for d in indices)
        if axis not in self._sizes():
            raise ValueError(f"unknown mesh axis {axis!r}: expected data, pipeline, context, "
                             f"tensor, partition or replica")
        return tuple(self.rank_of(**{**c, axis: i}) for i in range(self._sizes()[axis]))

    def groups(self, axis):
        """Every distinct group along `axis` (each a tuple of ranks), in rank order."""
        return sorted({self.group(axis, r) for r in range(self.size)})

    def describe(self):
        """A few lines for the start of a run: the grid and each rank's coordinates."""
        context = f"context {self.context} x " if self.context > 1 else ""
        order = self._axis_order if context else self.order
        lines = [f"mesh: {self.size} ranks = data {self.data} x pipeline {self.pipeline} x "
                 f"{context}tensor {self.tensor} (order {order}, last varies fastest)"]
        if 1 < self.shard_degree < self.data:
            lines.append(f"  sharded-DP partition groups of {self.shard_degree}: "
                         f"{self.groups('partition')}; replica groups: "
                         f"{self.groups('replica')}")
        if self.expert > 1:
            lines.append(f"  expert groups of {self.expert}: {self.groups('expert')}; expert "
                         f"replica groups: {self.groups('expert_replica')}")
        for axis in ("tensor", "context", "pipeline", "data"):
            if self._sizes()[axis] > 1:
                lines.append(f"  {axis} groups: {self.groups(axis)}")
        for rank in range(self.size):
            c = self.coords(rank)
            lines.append(f"  rank {rank}: data {c['data']} pipeline {c['pipeline']} "
                         + (f"context {c['context']} " if context else "")
                         + f"tensor {c['tensor']}")
        return "\n".join(lines)

    def process_set_ranks(self):
        """Every group of two or more ranks below the whole world, once (for hvd.init)."""
        axes = ("data", "pipeline", "context", "tensor", "partition", "replica", "model",
                "expert", "expert_replica")
        found = {g for axis in axes for g in self.groups(axis) if 1 < len(g) < self.size}
        # Adjacent pipeline stages exchange activations on a two-rank set of their own.
        found |= {pair for g in self.groups("pipeline") for pair in zip(g, g[1:])
                  if len(g) > 2}
        return sorted(found, key=lambda g: (len(g), g))


_KNOWN_SETS = {}  # ranks -> process set of this process's Horovod (declared or added)


def hvd_global_set():
    from tfbig.distribute.horovod_keras import hvd

    return hvd.global_process_set


class HorovodMesh:
    """A Mesh whose groups are Horovod process sets, all created at `hvd.init` (static sets).

    Every process must build the same Mesh (it follows from the flags), so they all declare
    the same process sets: at hvd.init when the mesh initialises Horovod, or, when Horovod is
    already running with HOROVOD_DYNAMIC_PROCESS_SETS=1 (several layouts in one launch, as
    the tests do), added then and kept for the next mesh that needs them.

    `process_set(axis)` is this rank's group along `axis`: the global set for the whole world,
    None for a group of one rank (nothing to communicate; the horovod_keras helpers return
    their input for None). `thread_policy` schedules Horovod's background threads when this
    mesh initialises Horovod (--hvd_thread_policy, horovod_keras.set_thread_policy).

    Example:
        hmesh = HorovodMesh.start(tensor=2)   # world size from horovodrun/mpirun
        hvd.allreduce(x, process_set=hmesh.process_set("tensor"))
    """

    def __init__(self, mesh, pin_gpu=True, thread_policy="auto"):
        from tfbig.distribute import horovod_keras
        from tfbig.distribute.horovod_keras import hvd

        self.mesh = mesh
        needed = mesh.process_set_ranks()
        if not hvd.is_initialized():  # static sets, declared at init (FACTS.md)
            sets = {ranks: hvd.ProcessSet(list(ranks)) for ranks in needed}
            horovod_keras.init(pin_gpu=pin_gpu, thread_policy=thread_policy,
                               process_sets=list(sets.values()))
            _KNOWN_SETS.clear()
            _KNOWN_SETS.update(sets)
        elif needed and not os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS"):
            raise RuntimeError(
                f"Horovod was initialised before the mesh ({mesh.data} x {mesh.pipeline} x "
                f"{mesh.context} x {mesh.tensor}) could declare its process sets: build the "
                f"strategy before anything calls hvd.init(), or launch with "
                f"HOROVOD_DYNAMIC_PROCESS_SETS=1")
        else:  # one process trying several layouts (tests): sets added once, kept for reuse
            for ranks in needed:
                if ranks not in _KNOWN_SETS:
                    _KNOWN_SETS[ranks] = hvd.add_process_set(list(ranks))
            sets = {ranks: _KNOWN_SETS[ranks] for ranks in needed}
        if hvd.size() != mesh.size:
            raise ValueError(f"the mesh has {mesh.size} ranks but horovodrun started "
                             f"{hvd.size()} processes")
        self._sets = sets
        self.rank = hvd.rank()

    @classmethod
    def start(cls, tensor=1, pipeline=1, shard_degree=0, placement="cluster", pin_gpu=True,
              context=1):
        """Build the Mesh for the launcher's world size and initialise Horovod with its sets."""
        return cls(Mesh.build(launcher_world_size(), tensor, pipeline, shard_degree, placement,
                              context), pin_gpu=pin_gpu)

    def process_set(self, axis, rank=None):
        """The process set of this rank's (or `rank`'s) group along `axis`; None for one rank."""
        return self._set_of(self.mesh.group(axis, self.rank if rank is None else rank))

    def pair_process_set(self, rank_a, rank_b):
        """The two-rank process set of adjacent pipeline stages `rank_a`, `rank_b`."""
        return self._set_of(tuple(sorted((rank_a, rank_b))))

    def _set_of(self, ranks):
        if len(ranks) == 1:
            return None
        return hvd_global_set() if len(ranks) == self.mesh.size else self._sets[ranks]

    @property
    def coords(self):
        return self.mesh.coords(self.rank)
