"""`tfbig-profile report RUN_DIR`: charts of a run's profile and a diagnosis of its bottleneck.

Writes RUN_DIR/profile/timeline.png (CPU, GPU, memory, I/O and step time over the run) and
breakdown.png (where a step's time goes), then prints the diagnosis with its evidence and
advice. The profiler trace of --profile_steps is in TensorBoard's Profile tab
(`tensorboard --logdir RUN_DIR`, with the tensorboard-plugin-profile package).

Example:
    tfbig-profile report runs/gpt-small
"""
import os

from tfbig.profiling.diagnose import diagnose, load_run, summarize
from tfbig.profiling.timing import PHASES

PHASE_COLORS = {"input": "tab:red", "compute": "tab:blue", "communication": "tab:orange",
                "checkpoint": "tab:gray"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def _origin(run):
    times = [s["time"] for s in run.samples[:1] + run.warmup[:1] + run.steps[:1]]
    return min(times) if times else 0.0


def _cpu_panel(ax, run, seconds, t0):
    cores = list(zip(*[s["cpu_percent"] for s in run.samples]))
    for i, core in enumerate(cores):
        ax.plot(seconds, core, lw=0.6, alpha=0.5, label="per core" if i == 0 else None)
    ax.plot(seconds, [s["cpu_mean"] for s in run.samples], lw=2, label="mean")
    ax.plot(seconds, [s["iowait_percent"] for s in run.samples], "--", label="I/O wait")
    ax.set_ylabel("CPU %")
    ax.set_ylim(0, 105)


def _gpu_panel(ax, run, seconds, t0):
    for index in sorted({g["index"] for s in run.samples for g in s["gpus"]}):
        gpu = [(x, g) for x, s in zip(seconds, run.samples) for g in s["gpus"]
               if g["index"] == index]
        x = [x for x, _ in gpu]
        ax.plot(x, [g["utilization_percent"] for _, g in gpu], label=f"GPU {index} util")
        ax.plot(x, [100 * g["memory_used_mb"] / g["memory_total_mb"] for _, g in gpu], ":",
                label=f"GPU {index} memory")
    ax.set_ylabel("GPU %")
    ax.set_ylim(0, 105)


def _memory_panel(ax, run, seconds, t0):
    ax.plot(seconds, [s["process_rss_mb"] for s in run.samples], label="process RSS")
    ax.set_ylabel("MB")
    host = ax.twinx()
    host.plot(seconds, [s["memory_used_percent"] for s in run.samples], "--",
              color="tab:purple", label="host used %")
    host.set_ylabel("host %")
    host.set_ylim(0, 105)


def _io_panel(ax, run, seconds, t0):
    ax.plot(seconds, [s["disk_read_mb_per_sec"] for s in run.samples], label="disk reads")
    ax.plot(seconds, [s["process_read_mb_per_sec"] for s in run.samples],
            label="process reads (incl. page cache)")
    ax.set_ylabel("MB/s")


def _steps_panel(ax, run, seconds, t0):
    x = [s["time"] - t0 for s in run.steps]
    ax.plot(x, [1000 * s["total"] for s in run.steps], ".-", ms=3, lw=0.8, label="step time")
    ax.plot(x, [1000 * s["input"] for s in run.steps], ".", ms=3, color=PHASE_COLORS["input"],
            label="input wait")
    for warm in run.warmup:  # the first step of each session compiles
        ax.axvspan(warm["time"] - t0 - warm["total"], warm["time"] - t0, color="tab:gray",
                   alpha=0.2, label="first step (compiles)" if warm is run.warmup[0] else None)
    ax.set_ylabel("ms")


def plot_timeline(run, path):
    """CPU, GPU (if any), memory, I/O and step-time panels over wall-clock seconds."""
    plt = _pyplot()
    t0 = _origin(run)
    seconds = [s["time"] - t0 for s in run.samples]
    has_gpu = any(s.get("gpus") for s in run.samples)
    panels = ([_cpu_panel] + ([_gpu_panel] if has_gpu else [])
              + [_memory_panel, _io_panel, _steps_panel])
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.3 * len(panels)), sharex=True)
    for ax, panel in zip(axes, panels):
        panel(ax, run, seconds, t0)
        ax.legend(loc="upper right", fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].set_title(f"{run.directory}: system and steps over the run")
    axes[-1].set_xlabel("seconds since start")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_breakdown(summary, path):
    """One stacked bar: the mean step split into input, compute, communication, checkpoint."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 2.6))
    left = 0.0
    for phase in PHASES:
        width = summary["step_ms"] * summary["shares"][phase]
        ax.barh(0, width, left=left, color=PHASE_COLORS[phase],
                label=f"{phase} {summary['shares'][phase]:.1%}")
        left += width
    ax.set_yticks([])
    ax.set_xlabel(f"ms per step (mean over {summary['steps']} steps: "
                  f"{summary['step_ms']:.1f} ms)")
    ax.set_title("step-time breakdown")
    fig.legend(loc="lower center", ncol=len(PHASES), fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def render(run_dir, output_dir=None):
    """Charts and findings of one run: (summary, findings, [png paths])."""
    run = load_run(run_dir)
    if not run.steps:
        raise ValueError(f"{run_dir} has no timed training steps yet (only the first step, "
                         f"which compiles); train at least two steps")
    output_dir = output_dir or os.path.join(run_dir, "profile")
    os.makedirs(output_dir, exist_ok=True)
    summary = summarize(run)
    charts = [plot_timeline(run, os.path.join(output_dir, "timeline.png")),
              plot_breakdown(summary, os.path.join(output_dir, "breakdown.png"))]
    return summary, diagnose(run, summary), charts


def format_report(summary, findings, charts):
    s = summary
    lines = [f"steps {s['steps']} | {s['step_ms']:.1f} ms/step | "
             f"{s['tokens_per_sec']:,.0f} tok/s"
             + (f" | MFU {s['mfu']:.1%}" if s["mfu"] is not None else ""),
             "step time: " + ", ".join(f"{p} {s['shares'][p]:.1%}" for p in PHASES)]
    if s["compile_seconds"]:
        lines.append(f"first step (compiles, not in the figures): {s['compile_seconds']:.1f} s")
    if s["monitor_overhead"] is not None:
        lines.append(f"system monitor: {s['samples']} samples, its own CPU time "
                     f"{s['monitor_overhead']:.2%} of the run")
    for i, finding in enumerate(findings):
        lines.append(("DIAGNOSIS: " if i == 0 else "also: ") + finding.kind)
        lines += [f"  evidence: {e}" for e in finding.evidence]
        lines += [f"  advice:   {a}" for a in finding.advice]
    lines += [f"chart: {c}" for c in charts]
    return "\n".join(lines)
