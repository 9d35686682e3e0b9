"""The cluster: GPU types (peak FLOP/s per precision, memory, bandwidths), nodes and links, and
the few physical constants every estimate uses.

Figures are vendor datasheet values for SXM parts, dense (no sparsity). Bandwidths are per GPU
and per direction: NVLink is what one GPU can send to the others of its node; the inter-node
figure is the node's network (e.g. 400 Gb/s EFA on p4d, 3200 Gb/s on p5), shared by the GPUs of
the node when they all communicate at once, which they do in every collective below.

Example:
    cluster = Cluster(gpu("A100-40GB", "mixed_bfloat16"), gpus_per_node=8, nodes=120,
                      internode_bandwidth=400e9 / 8)
"""
import dataclasses
import math

GB = 1e9
GIB = 2 ** 30

# Achieved / peak FLOP/s of the large matrix multiplies a transformer is made of: cuBLAS reaches
# 75-85% of the tensor-core peak on big GEMMs; 0.75 is that measured library figure, not a fit
# to any training run. A spec-table GPU runs smaller products further from it: each product
# also streams its operands through memory (tfbig.plan.estimate.matmul_fraction).
# On a CPU the peak is itself a measured matmul rate (tfbig.profiling.perf), so the fraction is 1.
MATMUL_FRACTION = 0.75
# Achieved / nominal bandwidth of large streaming transfers: NCCL/Gloo ring collectives reach
# ~80% of the link rate (bus bandwidth in nccl-tests), and memory-bound kernels ~80% of HBM
# bandwidth (STREAM-like copies).
BANDWIDTH_FRACTION = 0.8
# Memory a GPU loses before the first tensor: CUDA context, cuBLAS/cuDNN/XLA workspaces and the
# allocator's fragmentation (TF's BFC allocator).
GPU_RESERVE_BYTES = 2 * GIB
# Horovod's tensor-fusion buffer (HOROVOD_FUSION_THRESHOLD, default 128 MiB), held on every rank
# that averages gradients.
FUSION_BUFFER_BYTES = 128 * 2 ** 20

# name: (peak TFLOP/s by precision key, HBM GB, HBM GB/s, NVLink GB/s per direction)
GPUS = {
    "V100-16GB": ({"fp32": 15.7, "fp16": 125}, 16, 900, 150),
    "V100-32GB": ({"fp32": 15.7, "fp16": 125}, 32, 900, 150),
    "A100-40GB": ({"fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312}, 40, 1555, 300),
    "A100-80GB": ({"fp32": 19.5, "tf32": 156, "fp16": 312, "bf16": 312}, 80, 2039, 300),
    "H100-80GB": ({"fp32": 67, "tf32": 495, "fp16": 989, "bf16": 989}, 80, 3350, 450),
    "H200-141GB": ({"fp32": 67, "tf32": 495, "fp16": 989, "bf16": 989}, 141, 4800, 450),
}
# tfbig --precision -> the peak it runs at: the keys tfbig.profiling.perf reports MFU against (fp32 is the
# plain fp32 peak there, although TF may run fp32 matmuls as TF32 on A100/H100).
PRECISION_KEYS = {"fp32": "fp32", "mixed_float16": "fp16", "mixed_bfloat16": "bf16"}


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator as the estimates see it."""

    name: str
    peak_flops: float  # FLOP/s at the run's precision
    memory_bytes: float
    memory_bandwidth: float  # bytes/s (HBM, or DRAM on a CPU)
    local_bandwidth: float  # bytes/s per direction to the other devices of its node
    matmul_fraction: float = MATMUL_FRACTION
    reserve_bytes: float = GPU_RESERVE_BYTES
    # achieved / nominal memory bandwidth (1.0 where memory_bandwidth is itself measured)
    bandwidth_fraction: float = BANDWIDTH_FRACTION
    # ((square matmul size, achieved / peak), ...) measured (tfbig.plan.calibration); empty:
    # every matmul at matmul_fraction
    matmul_efficiency: tuple = ()
    # a spec-sheet device: each matmul at matmul_fraction of peak plus its operands' memory
    # traffic (its size sets its efficiency); False: every matmul at matmul_fraction
    roofline: bool = False
    # bytes/s a row normalisation (softmax, LayerNorm: a reduction along the row, then a map)
    # streams, as measured (tfbig.plan.calibration); 0: memory_bandwidth
    normalisation_bandwidth: float = 0.0
    # seconds the optimizer step spends per variable besides streaming its bytes (its ops'
    # launches), as measured (tfbig.plan.calibration); 0: not counted
    update_seconds_per_variable: float = 0.0


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`nodes` x `gpus_per_node` devices; `internode_bandwidth` bytes/s per node per direction."""

    device: Device
    gpus_per_node: int
    nodes: int
    internode_bandwidth: float
    # a tfbig.plan.calibration.Calibration: collectives at its measured times (None: the links)
    calibration: object = None

    @property
    def size(self):
        return self.gpus_per_node * self.nodes

    def link_bandwidth(self, span):
        """Bytes/s per GPU between ranks `span` apart: NVLink inside a node, else the node's
        network shared by all its GPUs (they all communicate at once)."""
        if span < self.gpus_per_node or self.nodes == 1:
            return self.device.local_bandwidth
        return self.internode_bandwidth / self.gpus_per_node

    def collective_time(self, size, ranks, stride, passes):
        """Seconds of a ring collective over `ranks` ranks `stride` apart, moving `size` bytes
        `passes` times (1: reduce-scatter or all-gather; 2: all-reduce).

        Hierarchical, as NCCL and the 2-hop sync of MiCS do: the r ranks of the group on one node
        reduce over NVLink first, then each of them syncs its 1/r slice across the nodes, all
        GPUs of a node at once through its network; r = 1 is a flat ring over the network."""
        if ranks == 1:
            return 0.0
        local = max(1, min(ranks, self.gpus_per_node // stride)) if stride < self.gpus_per_node \
            else 1
        nodes = ranks / local
        kind = "allreduce" if passes == 2 else "reducescatter"
        seconds = 0.0
        if local > 1:
            seconds += self._scope_time("intra_host", kind, size, local, passes,
                                        self.device.local_bandwidth)
        if nodes > 1:
            seconds += self._scope_time("inter_host", kind, size / local, nodes, passes,
                                        self.link_bandwidth(self.gpus_per_node))
        return seconds

    def _scope_time(self, scope, kind, size, ranks, passes, bandwidth):
        """A ring over `ranks` ranks of one scope: measured (the calibration's) or from the
        link's `bandwidth`."""
        if self.calibration is not None and self.calibration.has(scope):
            return self.calibration.collective_seconds(scope, kind, size, ranks)
        return passes * (ranks - 1) / ranks * size / bandwidth / BANDWIDTH_FRACTION


def log_interpolate(points, x):
    """Linear in log(x) between sorted (x, y) points, held at the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return points[-1][1]


def gpu(name, precision="fp32"):
    """The Device of a GPU type in `GPUS` at a tfbig --precision."""
    if name not in GPUS:
        raise ValueError(f"--gpu={name!r} is not in the GPU table; choose one of {list(GPUS)}, "
                         f"or describe the device with --peak_tflops and --hbm_gb")
    if precision not in PRECISION_KEYS:
        raise ValueError(f"--precision={precision!r}: expected one of {list(PRECISION_KEYS)}")
    peaks, hbm, hbm_bandwidth, nvlink = GPUS[name]
    key = PRECISION_KEYS[precision]
    if key not in peaks:
        raise ValueError(f"--precision={precision} has no hardware support on {name} (it has "
                         f"{sorted(peaks)}); choose another --precision or --gpu")
    return Device(name, peaks[key] * 1e12, hbm * GB, hbm_bandwidth * GB, nvlink * GB,
                  roofline=True)


def custom_device(peak_tflops, hbm_gb, memory_gbps=2000.0, link_gbps=300.0):
    """A device described by flags (--peak_tflops --hbm_gb; bandwidths in GB/s)."""
    for flag, value in (("peak_tflops", peak_tflops), ("hbm_gb", hbm_gb)):
        if not value or value <= 0:
            raise ValueError(f"--{flag}={value}: give a positive number (or --gpu from "
                             f"{list(GPUS)})")
    return Device(f"custom-{peak_tflops:g}TF-{hbm_gb:g}GB", peak_tflops * 1e12, hbm_gb * GB,
                  memory_gbps * GB, link_gbps * GB)
